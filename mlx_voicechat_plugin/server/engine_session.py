"""A connection's engine side: its session opened, audio in, markers, the hand-offs back.

:class:`EngineSession` is the half of :class:`~.connection.Connection` that
talks to the engine: it opens the session (:meth:`~EngineSession.open_session`,
with typed options from :mod:`.options`), hands audio to the bounded
:class:`~.feed.InputFeed`, queues markers behind it (:meth:`~EngineSession.settle`,
tool results) and releases the session on every exit path. It is the
session's sink: once per engine cycle, on this event loop, the engine hands
it the frames' runtime events, a frame's error and its markers' replies in
order (:meth:`~EngineSession.on_handoff`); the dialect translates the events
here (``translate``), so its state is only ever touched by this loop. The
socket side (reading, deadlines, sending, the dialect's hooks) is the
connection's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from ..runtime.options import SessionOptions
from ..runtime.pool import PoolFull
from ..runtime.streaming import ContextLimit, TranscriptLimit
from .engine.channel import Handoff
from .engine.commands import Close, OpenOptions, SessionDetails
from .engine.thread import Engine
from .engine.feed import InputFeed
from .limits import ServerLimits
from .transport.outbox import ClientNotReading
from .wire import ErrorCode, ProtocolError, dumps, inference_error, init_failed, new_session_id

logger = logging.getLogger(__name__)


def stream_full(exc: BaseException) -> bool:
    """Whether a frame's error is its stream reaching ``max_streaming_seconds``
    (:class:`ContextLimit`; a transcript's byte limit is another matter)."""
    return isinstance(exc, ContextLimit) and not isinstance(exc, TranscriptLimit)


class EngineSession:
    """One connection's session in the engine (the connection provides the socket side:
    ``outbox``, ``watch``, ``error_payload``, ``translate``, ``limit_reached``)."""

    def __init__(self, engine: Engine, limits: ServerLimits):
        self.engine = engine
        self.limits = limits
        self.session_id = new_session_id()
        self.configured = False
        self.tools_set = False
        self.open = False  # the engine holds our streaming session
        self.closing: asyncio.Future | None = None  # the engine's close, once queued
        self.details: SessionDetails | None = None  # of the open session
        self.feed: InputFeed | None = None  # the session's input queue, from the first audio
        self.event_loop: asyncio.AbstractEventLoop | None = None  # where the engine hands off
        self.frames_run = 0  # frames of the session whose events were handed over

    # --- the engine's hand-offs (on the loop) ------------------------------------------

    def on_handoff(self, handoff: Handoff) -> None:
        """What the engine did for the session in one cycle (on the loop), in order: a
        frame's events (translated here), a frame's error, a marker's reply."""
        if handoff.consumed and self.feed is not None:
            self.feed.consumed(handoff.consumed)
        for entry in handoff.entries:
            if isinstance(entry, list):
                self.frames_run += 1
                self.deliver(self.translate(entry))
            elif isinstance(entry, BaseException):
                self.frame_error(entry)
            else:
                entry.resolve()

    def deliver(self, texts: list[str]) -> None:
        """Texts of the engine's output (on the loop): into the outbox, in order."""
        try:
            for text in texts:
                self.outbox.put(text)
        except ClientNotReading as exc:
            self.input_feed().halt(exc)

    def frame_error(self, exc: BaseException) -> None:
        """A queued frame failed: ``inference_error`` (the rest of its append is dropped)."""
        message = str(exc) or type(exc).__name__
        logger.info("%s error %s: %s", self.session_id, ErrorCode.INFERENCE_ERROR, message)
        self.deliver([dumps(self.error_payload(ErrorCode.INFERENCE_ERROR, message))])
        if stream_full(exc):
            self.limit_reached()

    # --- the session ---------------------------------------------------------------------

    async def open_session(self, options: OpenOptions) -> SessionDetails:
        """Open the engine session (closing one opened before), watching the socket while
        its prompt prefills; a failure is ``session_initialization_failed``."""
        if self.open:
            self.open = False
            await self.engine.close(self.session_id)
        self.configured = False
        self.event_loop, self.frames_run = asyncio.get_running_loop(), 0
        opening = self.engine.open(self.session_id, options, self)
        self.open = True  # the engine may hold a stream from now on: release closes it
        await self.watch(opening)
        try:
            details = opening.result()
        except PoolFull as exc:  # its reservation does not fit --max-state-bytes
            raise ProtocolError(ErrorCode.SERVER_BUSY, str(exc)) from None
        except Exception as exc:
            raise init_failed(str(exc)) from None
        self.configured = True
        self.tools_set = isinstance(options, SessionOptions) and options.tools is not None
        self.details = details
        return details

    async def feed_audio(self, samples: np.ndarray) -> None:
        """Client audio at the session's input rate, queued (not awaited: its frames run
        in batched steps with the other sessions' and their events come back in order);
        the session counts as active."""
        if not samples.shape[0]:
            return
        self.active()
        await self.input_feed().append(samples)

    def input_feed(self) -> InputFeed:
        """The session's bounded input queue (``--max-buffered-seconds``)."""
        if self.feed is None:
            bound = self.limits.buffered_samples(self.details.input_sample_rate,
                                                 self.details.frame_samples)
            self.feed = InputFeed(self.engine, self.session_id, bound, self)
        return self.feed

    async def settle(self) -> None:
        """Wait until the audio queued so far has run and its events went out: what
        the client sends besides audio is answered in order, after them."""
        if self.feed is not None:
            await self.engine_call(self.engine.sync(self.session_id))

    async def tool_output(self, call_id: str, output: str) -> None:
        """A tool result: its tokens enter the timeline at the next frames."""
        if not self.tools_set:
            raise ProtocolError(ErrorCode.TOOLS_NOT_SET,
                                "function_call_output needs tools registered in session.update")
        try:
            await self.engine.tool_result(self.session_id, call_id, output)
        except ValueError as exc:  # unknown / answered call_id, non-ASCII output
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        except Exception as exc:
            raise inference_error(exc) from None

    async def engine_call(self, call: Any) -> Any:
        """Await an engine command; its failure is the client's ``inference_error``."""
        try:
            return await call
        except Exception as exc:
            raise inference_error(exc) from None

    # --- release ---------------------------------------------------------------------------

    def let_go(self) -> None:
        """Queue the engine's close (cancelling unflushed audio) and free the slot, now.

        The close is queued before the slot is freed, and the engine runs its
        commands in order, so a client reconnecting at once is admitted and
        its session opens after this one is gone. Safe to call again.
        """
        if self.open:
            self.open = False
            self.closing = self.engine.submit(Close(self.session_id))
        self.engine.admission.release(self.session_id)

    async def release(self) -> None:
        """:meth:`let_go`, then wait for the engine to have closed the session."""
        self.let_go()
        closing, self.closing = self.closing, None
        if closing is not None:
            try:
                await closing
            except Exception:
                logger.exception("closing %s failed", self.session_id)
