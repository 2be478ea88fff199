"""Bounds a realtime server puts on each client, each defined once, here, and checked once.

A session's own options (its context, streaming seconds, prompt tokens,
transcript bytes) are the runtime's (:mod:`~..runtime.options`); the server
sets them from these bounds when a dialect builds them
(:mod:`.dialects.client_options`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..runtime.options import (
    DEFAULT_CONTEXT_SECONDS, buffered_samples, check_context_seconds, check_count,
    check_non_negative, check_positive_int, check_positive_seconds, check_temperature,
    check_top_p,
)
from ..runtime.tool_failures import DEFAULT_TOOL_TIMEOUT

MIB = 1 << 20
# The transport accepts a little more than ``max_message_bytes`` so that a
# slightly oversized message is answered with a clean ``error`` event; anything
# past the transport cap is closed by the WebSocket layer with code 1009.
TRANSPORT_SLACK_BYTES = 64 * 1024
# How long a step's first ready frame may wait for the other sessions' frames
# (measured with bench.load: docs/serving.md, "Serving many sessions").
DEFAULT_BATCH_WAIT_MS = 30.0
# Detached sessions one API key holds by default. A key is a person's (a phone
# that switched networks, a laptop, two tabs: all dropped at one network
# change) or a backend's, shared by the few users it relays at a time; more
# than that, from one key, is a client opening and dropping connections in a
# loop. Detached sessions give their slots to newcomers anyway: this bounds
# what one key keeps while the server has room.
DEFAULT_MAX_DETACHED_PER_KEY = 4
# Bytes of new events one connection may leave unsent before its client counts as
# not reading. A reading client's backlog is a few events: a normal session's
# largest steady stream, 80 ms audio deltas (24 kHz PCM16 as base64, ~5 KiB each),
# fills 8 MiB only after ~1,600 unread deltas (~2 minutes of speech), far past the
# 256-event bound; what reaches it is large events left unread (1 MiB item echoes).
DEFAULT_MAX_PENDING_BYTES = 8 * MIB


@dataclass(frozen=True)
class ServerLimits:
    """Per-connection limits (sizes in bytes, times in seconds)."""

    max_message_bytes: int = MIB
    max_session_seconds: float = 600.0
    update_timeout: float = 30.0
    idle_timeout: float = 120.0
    max_pending_events: int = 256  # unsent events before a client counts as not reading
    # Bytes of unsent new events (as sent) before a client counts as not reading.
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    send_timeout: float = 10.0  # longest wait for queued events (and the close) at the end
    # Bytes a second one WebSocket's (or call's data channel's) messages are read at, past
    # a burst of four messages at the cap (read_burst_bytes): a faster client waits, it is
    # not refused.
    # Real-time audio is ~64 KiB/s; a file client streams at ~30x real time under it.
    max_read_bytes_per_second: int = 2 * MIB
    max_session_wall_seconds: float = 1800.0  # a connection's whole life, whatever it sends
    max_failed_updates: int = 3  # failed session.update messages before close 1008
    max_prompt_tokens: int = 2048  # system prompt + rendered tools, checked before prefill
    prompt_cache_bytes: int = 256 * MIB  # prefilled states kept for repeated prompts (0: off)
    max_connections: int = 128  # open sockets in all, before any authentication
    max_connections_per_client: int = 64  # open sockets from one address
    header_timeout: float = 10.0  # each request's headers (and a WebSocket handshake) by then
    body_timeout: float = 120.0  # a request's body must arrive this long after its headers
    max_sessions: int = 1  # realtime sessions served at once (engine slots)
    max_state_bytes: int | None = None  # measured session state in all, before refusing more
    max_transcript_bytes: int = 64 * 1024  # a text-only session's transcript (UTF-8)
    # One /v1/audio/transcriptions file, and the audio it may hold (None: what the
    # memory budget allows, transcription_limits).
    max_upload_bytes: int | None = None
    max_transcription_seconds: float | None = None
    max_transcriptions_in_flight: int = 4  # file transcriptions admitted and not finished
    max_buffered_seconds: float = 2.0  # audio one session may queue ahead of the engine
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS  # a step's collection deadline (0: never wait)
    batch_fill: bool = True  # past the unbatched capacity, wait for every streaming session
    # Seconds of conversation a session's attention keeps after its prompt (None: unbounded).
    context_seconds: float | None = DEFAULT_CONTEXT_SECONDS
    # A session's sampling where its client sets none (mlx-lm's names; the reference's:
    # greedy text, the checkpoint's tts_config.top_p when None).
    temperature: float = 0.0
    top_p: float | None = None
    # A session whose connection drops (no close) waits this long to be resumed (0: off).
    resume_seconds: float = 15.0
    # Seconds of frames whose events a session keeps for a resume's replay.
    max_replay_seconds: float = 10.0
    # Detached sessions one API key may hold; past it its oldest ends.
    max_detached_per_key: int = DEFAULT_MAX_DETACHED_PER_KEY
    # Bytes of events (as sent) a session keeps for a resume's replay; the oldest go.
    max_replay_bytes: int = 8 * MIB
    # Bytes of conversation items (as sent) a GA session keeps; a client's item past
    # them is refused with an error, the server's own push the oldest out.
    max_item_bytes: int = 4 * MIB
    # Bytes of minted sessions (their JSON) the unexpired ephemeral keys hold, all
    # together; a mint past them is refused (429).
    max_minted_bytes: int = 16 * MIB
    # Seconds a client-run tool call may wait for its function_call_output.
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "ServerLimits":
        """The limits named in ``values`` (e.g. ``vars()`` of the parsed CLI flags; other
        keys are ignored), the defaults for the rest."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (values or {}).items() if k in names})

    def __post_init__(self) -> None:
        """Every bound checked once, here (the engine and the pool trust them), with the
        runtime's checks; the message names the field (``serve`` prints it)."""
        for name in ("max_message_bytes", "max_pending_events", "max_pending_bytes",
                     "max_read_bytes_per_second",
                     "max_failed_updates",
                     "max_prompt_tokens", "max_connections", "max_connections_per_client",
                     "max_sessions", "max_transcript_bytes",
                     "max_transcriptions_in_flight", "max_detached_per_key",
                     "max_replay_bytes", "max_item_bytes", "max_minted_bytes"):
            check_positive_int(getattr(self, name), name)
        if self.max_upload_bytes is not None:
            check_positive_int(self.max_upload_bytes, "max_upload_bytes")
        if self.max_transcription_seconds is not None:
            check_positive_seconds(self.max_transcription_seconds, "max_transcription_seconds")
        if self.max_state_bytes is not None:
            check_positive_int(self.max_state_bytes, "max_state_bytes")
        check_count(self.prompt_cache_bytes, "prompt_cache_bytes")
        for name in ("max_session_seconds", "update_timeout", "idle_timeout", "send_timeout",
                     "max_session_wall_seconds", "header_timeout", "body_timeout",
                     "max_buffered_seconds"):
            check_positive_seconds(getattr(self, name), name)
        check_non_negative(self.batch_wait_ms, "batch_wait_ms")
        check_non_negative(self.resume_seconds, "resume_seconds")
        check_positive_seconds(self.max_replay_seconds, "max_replay_seconds")
        check_positive_seconds(self.tool_timeout, "tool_timeout")
        object.__setattr__(self, "context_seconds", check_context_seconds(self.context_seconds))
        object.__setattr__(self, "temperature", check_temperature(self.temperature))
        object.__setattr__(self, "top_p", check_top_p(self.top_p))
        if not isinstance(self.batch_fill, bool):
            raise ValueError(f"batch_fill must be true or false, got {self.batch_fill!r}")

    def transcription_limits(self, plan: Any) -> tuple[int, float]:
        """``(max_upload_bytes, max_transcription_seconds)`` of the transcription route:
        those set, the rest what the memory budget allows
        (:func:`~..budget.transcription_bounds` of the loaded model's ``plan``:
        OpenAI's 25 MiB and 600 s at least)."""
        from ..budget import transcription_bounds

        upload, seconds = transcription_bounds(plan, self.max_transcriptions_in_flight)
        return (upload if self.max_upload_bytes is None else self.max_upload_bytes,
                seconds if self.max_transcription_seconds is None
                else self.max_transcription_seconds)

    @property
    def resumable(self) -> bool:
        """Whether a dropped connection's session waits to be resumed (``--resume-seconds``)."""
        return self.resume_seconds > 0

    def buffered_samples(self, sample_rate: int, frame_samples: int) -> int:
        """The most PCM samples one session may queue (never less than a frame)."""
        return buffered_samples(self.max_buffered_seconds, sample_rate, frame_samples)

    def uvicorn_options(self) -> dict:
        """What ``uvicorn.run`` / ``uvicorn.Config`` need to enforce the socket-level limits."""
        from .transport.guard import ConnectionGuard, uvicorn_protocols

        guard = ConnectionGuard(self.max_connections, self.max_connections_per_client,
                                self.header_timeout, body_timeout=self.body_timeout)
        return {"ws_max_size": self.transport_max_bytes, **uvicorn_protocols(guard)}

    @property
    def read_burst_bytes(self) -> int:
        """The read rate's burst: four messages at ``max_message_bytes``."""
        return 4 * self.max_message_bytes

    @property
    def transport_max_bytes(self) -> int:
        """The WebSocket layer's own frame cap (``ws_max_size``)."""
        return self.max_message_bytes + TRANSPORT_SLACK_BYTES
