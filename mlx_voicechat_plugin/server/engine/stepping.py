"""The open sessions' channels on the engine thread: markers run, batched pool steps, hand-offs.

Each open session has a :class:`~.channel.StreamChannel`, made when its
open (a job: :meth:`Stepper.open_steps`) ends. In every engine
cycle :meth:`Stepper.run_markers` runs the markers that reached the head of
their channel (commit, cancel, a tool result, a barrier; the partial frame
before a marker stays in its channel, a commit takes it along);
:meth:`Stepper.step` cuts one native frame of every session that has one
ready, when :class:`~.scheduler.BatchScheduler` says so, and runs them as one
:meth:`~..runtime.pool.StreamPool.step`; :meth:`Stepper.send` hands each
session's runtime events, errors and marker replies to its sink, once per
cycle. No JSON is made here: a session's connection translates its events on
its own event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Generator

from ...runtime.events import Cancelled
from ...runtime.options import TranscriptionOptions
from ...runtime.pool import StreamPool
from ...runtime.timeline import PrefillCancelled
from .channel import FrameError, FrameEvents, Reply, StreamChannel
from .commands import Cancel, Command, Flush, Open, SessionDetails, Sync, ToolResult
from .metrics import EngineMetrics
from .scheduler import BatchScheduler

logger = logging.getLogger(__name__)

NOT_ACTIVE = "realtime session is not active"
# Longest a new session's prefill runs before the other sessions' frames do.
PREFILL_SLICE_SECONDS = 0.02
# How often, at most, the sessions' measured state is read onto the gauge (and the
# ledger a health check reads) while only frames run: sizing every session's state
# is host work per session, not to be done every 80 ms frame.
STATE_GAUGE_SECONDS = 1.0


class Stepper:
    """Every open session's channel (engine thread only)."""

    def __init__(self, metrics: EngineMetrics, pool: StreamPool | None,
                 scheduler: BatchScheduler):
        """``pool``: the loaded model's (``None`` when it failed to load: no session opens)."""
        self.metrics = metrics
        self.pool = pool
        self.scheduler = scheduler
        self.channels: dict[str, StreamChannel] = {}
        self._gauged = 0.0  # when the state gauge was last read after a step

    # --- what is due --------------------------------------------------------------

    def markers_due(self) -> bool:
        return any(c.head_marker() is not None for c in self.channels.values())

    def wait(self) -> float | None:
        """Seconds until the next step is due (0: now), ``None`` when no frame is ready."""
        return self.scheduler.wait(self.channels, time.perf_counter())

    def add_marker(self, command: Command) -> bool:
        """Queue a marker behind its session's audio; ``False`` when the session is not open."""
        channel = self.channels.get(command.session_id)
        if channel is None:
            return False
        channel.add_marker(command)
        return True

    # --- opening ----------------------------------------------------------------------

    def open_steps(self, command: Open, abort: threading.Event
                   ) -> Generator[list, None, SessionDetails]:
        """Open a session, its prompt prefill in slices of at most
        ``PREFILL_SLICE_SECONDS`` (yielding between them, so a new session's prefill
        holds the others up by one slice at a time) until ``abort`` is set; then
        its channel."""
        pool, session_id, options = self.pool, command.session_id, command.options
        opening = pool.open_steps(session_id, options)
        try:
            slice_end = time.perf_counter() + PREFILL_SLICE_SECONDS
            while True:
                if abort.is_set():  # between two positions: the pool frees the slot
                    raise PrefillCancelled("the session's prefill was stopped")
                try:
                    next(opening)
                except StopIteration as opened:
                    stream = opened.value
                    break
                if time.perf_counter() >= slice_end:
                    yield []  # the others' frames run now
                    slice_end = time.perf_counter() + PREFILL_SLICE_SECONDS
        except BaseException:
            opening.close()
            raise
        finally:
            self.metrics.sessions(len(pool), pool.state_bytes)
        self.channels[session_id] = StreamChannel(stream.frame_samples, command.sink)
        return SessionDetails(stream.sample_rate, pool.voicechat.config.output_sample_rate,
                              stream.frame_samples, stream.options.max_streaming_seconds,
                              isinstance(options, TranscriptionOptions))

    # --- markers --------------------------------------------------------------------

    def run_markers(self) -> None:
        """Run the markers that reached the head of their channel, in order."""
        for session_id, channel in list(self.channels.items()):
            while channel.head_marker() is not None:
                command = channel.pop_marker(time.perf_counter())
                try:
                    value = self._marker(session_id, channel, command)
                except Exception as exc:
                    # Reported to the client, and logged once there (Dialect.send_error).
                    logger.debug("engine %s failed for %s: %s", type(command).__name__,
                                 session_id, exc, exc_info=True)
                    channel.emit(Reply(command, error=exc))
                else:
                    channel.emit(Reply(command, value))

    def _marker(self, session_id: str, channel: StreamChannel, command: Command) -> Any:
        pool = self.pool
        if isinstance(command, Sync):  # every frame queued before it has run
            return None
        stream = pool.get(session_id)
        if isinstance(command, Flush):
            before, started = stream.frame_index, time.perf_counter()
            events = pool.flush(session_id, command.pad_partial, channel.take_partial())
            frames, seconds = stream.frame_index - before, time.perf_counter() - started
            self.metrics.step(frames, seconds, pool.voicechat.config.frame_duration)
            channel.paced(frames, seconds, pool.voicechat.config.frame_duration)
            self.metrics.sessions(len(pool), pool.state_bytes)
            return events
        if isinstance(command, Cancel):
            channel.take_partial()  # what the stream was still to hear
            # A client that cancels always hears it cancelled, also after a
            # failed commit closed the stream.
            return pool.cancel(session_id) or [Cancelled(stream.frame_index)]
        if isinstance(command, ToolResult):
            stream.submit_tool_result(command.call_id, command.output)
            return None
        raise TypeError(f"not a marker: {command!r}")

    # --- frames ---------------------------------------------------------------------

    def step(self) -> None:
        """One pool step: a frame of every session that has one ready."""
        pool, scheduler = self.pool, self.scheduler
        config = pool.voicechat.config
        ready = scheduler.ready(self.channels)
        now = started = time.perf_counter()
        waited = now - scheduler.collection_start(self.channels, ready)
        frames, tags = {}, {}
        for session_id in ready:
            frames[session_id], tags[session_id] = self.channels[session_id].take_frame(now)
        result = pool.step(frames)
        self.metrics.step(result.frames, result.seconds, config.frame_duration)
        self.metrics.collected(waited)
        for session_id in ready:
            channel = self.channels[session_id]
            error = result.errors.get(session_id)
            if error is None:
                channel.paced(1, result.seconds, config.frame_duration)  # one frame each
                channel.emit(FrameEvents(result.events[session_id]))
                continue
            logger.debug("engine frame failed for %s: %s", session_id, error, exc_info=error)
            channel.drop_tag(tags[session_id], time.perf_counter())
            channel.emit(FrameError(error))
        done = time.perf_counter()
        if done - self._gauged >= STATE_GAUGE_SECONDS:
            self._gauged = done
            self.metrics.sessions(len(pool), pool.state_bytes)
        self.metrics.buffered(sum(c.buffered for c in self.channels.values())
                              / config.input_sample_rate)
        scheduler.free_since = time.perf_counter()
        scheduler.record(result.frames, scheduler.free_since - started)

    def send(self) -> None:
        """Every session's hand-off of this cycle, to its sink."""
        for channel in self.channels.values():
            channel.send()

    # --- closing ----------------------------------------------------------------------

    def drop(self, session_id: str) -> None:
        """Forget a closing session's channel; its markers are answered with an error."""
        channel = self.channels.pop(session_id, None)
        if channel is None:
            return
        gone = RuntimeError(NOT_ACTIVE)
        for marker in list(channel.drain()):
            channel.emit(Reply(marker, error=gone))
        channel.send()

    def drop_all(self) -> None:
        for session_id in list(self.channels):
            self.drop(session_id)
