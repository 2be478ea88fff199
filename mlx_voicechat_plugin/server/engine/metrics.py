"""What the engine did, in Prometheus text format (``/metrics``): counted on the engine
thread, read on the event loop at each scrape.

Every figure is counted where it happens: frames are the frames the sessions
ran (``StreamPool.step``), steps are timed around the step, state bytes are
the measured ``nbytes`` of the open sessions. Each engine has its own
registry, so several servers in one process (the tests) do not share counts.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .client_metrics import ClientMetrics

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16)
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class EngineMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_sessions: int):
        self.registry = CollectorRegistry()
        r = self.registry
        self.active = Gauge("voicechat_active_sessions", "Open realtime sessions", registry=r)
        self.capacity = Gauge("voicechat_max_sessions", "Session slots (--max-sessions)",
                              registry=r)
        self.capacity.set(max_sessions)
        self.state = Gauge("voicechat_session_state_bytes",
                           "Measured bytes of the open sessions' state arrays", registry=r)
        self.reserved = Gauge("voicechat_session_reserved_bytes",
                              "Worst-case state the open sessions reserve (admission counts it)",
                              registry=r)
        self.frames = Counter("voicechat_frames", "80 ms frames run, all sessions", registry=r)
        self.late = Counter("voicechat_late_frames",
                            "Frames of steps slower than one frame of wall time", registry=r)
        self.refused = Counter("voicechat_admissions_refused",
                               "Connections refused with server_busy (no slot or state budget)",
                               registry=r)
        self.batch = Histogram("voicechat_step_batch_size", "Frames per engine step",
                               buckets=BATCH_BUCKETS, registry=r)
        self.step_seconds = Histogram("voicechat_step_seconds", "Wall time of one engine step",
                                      buckets=STEP_BUCKETS, registry=r)
        self.batch_wait = Histogram(
            "voicechat_batch_wait_seconds",
            "Time a step's ready frames waited, the engine free, for other sessions' frames "
            "(--batch-wait-ms)", buckets=WAIT_BUCKETS, registry=r)
        self.input_buffered = Gauge("voicechat_input_buffered_seconds",
                                    "Audio queued ahead of the engine, all sessions", registry=r)

        self.transcriptions = Counter("voicechat_transcriptions",
                                      "File transcriptions finished (/v1/audio/transcriptions)",
                                      registry=r)
        self.transcribed_seconds = Counter("voicechat_transcribed_audio_seconds",
                                           "Seconds of audio in finished file transcriptions",
                                           registry=r)
        self.transcriptions_refused = Counter(
            "voicechat_transcriptions_refused",
            "File transcriptions refused with 429 (--max-transcriptions-in-flight)", registry=r)
        self.transcriptions_in_flight = Gauge(
            "voicechat_transcriptions_in_flight", "File transcriptions admitted, not finished",
            registry=r)
        self.clients = ClientMetrics(r)  # what the dialects' sessions did on the wire

    def transcribed(self, seconds: float) -> None:
        self.transcriptions.inc()
        self.transcribed_seconds.inc(seconds)

    def step(self, frames: int, seconds: float, frame_duration: float) -> None:
        """A step ran ``frames`` frames (one per session) in ``seconds``."""
        if not frames:
            return
        self.frames.inc(frames)
        self.batch.observe(frames)
        self.step_seconds.observe(seconds)
        if seconds > frame_duration:
            self.late.inc(frames)

    def collected(self, seconds: float) -> None:
        """A step's frames waited ``seconds`` for the batch to form."""
        self.batch_wait.observe(max(seconds, 0.0))

    def buffered(self, seconds: float) -> None:
        self.input_buffered.set(seconds)

    def sessions(self, active: int, state_bytes: int) -> None:
        self.active.set(active)
        self.state.set(state_bytes)

    def watch_reserved(self, reserved: Callable[[], int]) -> None:
        """Read the reserved bytes from ``reserved`` at each scrape."""
        self.reserved.set_function(reserved)

    def render(self) -> bytes:
        return generate_latest(self.registry)
