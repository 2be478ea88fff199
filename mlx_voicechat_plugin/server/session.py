"""One realtime session: its engine side, its dialect's state and its clocks, in no transport.

A :class:`Session` runs on the event loop. It opens the engine session
(:meth:`~Session.open_session`, with the typed options its dialect built:
:mod:`.dialects.client_options`), hands audio to the bounded
:class:`~.engine.feed.InputFeed`, queues markers behind it
(:meth:`~Session.settle`, tool results) and is the engine's sink: once per
engine cycle the engine hands it the frames' runtime events, a
frame's error and its markers' replies in order (:meth:`~Session.on_handoff`),
which its dialect (:attr:`~Session.dialect`, the per-session state of
:mod:`.dialects`) translates into typed messages (:mod:`.messages`).

The messages go to the attached :class:`Link` (a connection, which owns a
transport). A session can outlive its transport when asked
(:attr:`~Session.outlives_transport`): the transport's end detaches it
(:meth:`~Session.detach`; its messages wait, bounded, for the next link),
and :meth:`~Session.attach` gives it another. Its clocks (the update, idle
and wall-clock deadlines, :meth:`~Session.expired`) and the dialect's own
timers (:meth:`~Session.spawn`, e.g. GA's owed response) run on the loop
with or without a transport; a detached session whose deadline passes is
released. It is released on every exit path (:meth:`~Session.release`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable, Coroutine, Protocol

import numpy as np

from ..runtime.options import SessionOptions
from ..runtime.pool import PoolFull
from ..runtime.streaming import ContextLimit, TranscriptLimit
from .engine.channel import Handoff
from .engine.commands import Close, OpenOptions, SessionDetails
from .engine.feed import InputFeed
from .engine.thread import Engine
from .limits import ServerLimits
from .messages import ClientNotReading, Outgoing
from .wire import ErrorCode, ProtocolError, inference_error, init_failed, new_session_id

logger = logging.getLogger(__name__)


def stream_full(exc: BaseException) -> bool:
    """Whether a frame's error is its stream reaching ``max_streaming_seconds``
    (:class:`ContextLimit`; a transcript's byte limit is another matter)."""
    return isinstance(exc, ContextLimit) and not isinstance(exc, TranscriptLimit)


class Link(Protocol):
    """Where an attached session's messages go (a connection, over its transport)."""

    def send(self, message: Outgoing) -> None:
        """Queue ``message`` for the client; :class:`ClientNotReading` if it cannot."""

    async def watch(self, opening: asyncio.Future) -> None:
        """Wait for the engine to open the session while watching the transport."""


class SessionDialect(Protocol):
    """What the session asks of its dialect (on the loop)."""

    def translate(self, events: list) -> list[Outgoing]:
        """One frame's (or a command's) runtime events as the messages sent, in order."""

    def frame_error(self, exc: BaseException) -> list[Outgoing]:
        """A queued frame failed: what the client is told."""


class Session:
    """One client's session in the engine, with or without a transport attached."""

    def __init__(self, engine: Engine, limits: ServerLimits):
        self.engine = engine
        self.limits = limits
        self.session_id = new_session_id()
        self.dialect: SessionDialect | None = None  # set once by whoever makes the session
        self.configured = False
        self.tools_set = False
        self.open = False  # the engine holds our streaming session
        self.closing: asyncio.Future | None = None  # the engine's close, once queued
        self.details: SessionDetails | None = None  # of the open session
        self.feed: InputFeed | None = None  # the session's input queue, from the first audio
        self.event_loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        self.frames_run = 0  # frames of the session whose events were handed over
        self.connected_at = time.monotonic()
        self.last_activity = self.connected_at  # last audio or successful request
        # While this says so (GA: a response is owed), idle time does not count.
        self.keep_alive: Callable[[], bool] | None = None
        # One thing acts on the session at a time: a client message, a timer's step.
        self.turn = asyncio.Lock()
        # Resolves with the exception that ends the conversation (a client not
        # reading, a full stream): the connection raises it at its next wait.
        self.halted: asyncio.Future = self.event_loop.create_future()
        self.link: Link | None = None
        self.outlives_transport = False  # detach, not release, when the transport ends
        self.detached = False  # its transport ended and it goes on, awaiting another
        self.pending: deque[Outgoing] = deque()  # messages made while detached
        self.released = False
        self._tasks: set[asyncio.Task] = set()
        self._expiry: asyncio.Task | None = None  # a detached session's deadline

    # --- the engine's hand-offs (on the loop) ------------------------------------------

    def on_handoff(self, handoff: Handoff) -> None:
        """What the engine did for the session in one cycle (on the loop), in order: a
        frame's events (translated here), a frame's error, a marker's reply."""
        if handoff.consumed and self.feed is not None:
            self.feed.consumed(handoff.consumed)
        for entry in handoff.entries:
            if isinstance(entry, list):
                self.frames_run += 1
                self.deliver(self.dialect.translate(entry))
            elif isinstance(entry, BaseException):
                self.frame_error(entry)
            else:
                entry.resolve()

    def deliver(self, messages: list[Outgoing]) -> None:
        """Messages of the engine's output (on the loop), in order; a client that does
        not read them halts the session."""
        try:
            self.send_all(messages)
        except ClientNotReading as exc:
            self.halt(exc)

    def frame_error(self, exc: BaseException) -> None:
        """A queued frame failed (the rest of its append is dropped): the dialect says so."""
        logger.info("%s error %s: %s", self.session_id, ErrorCode.INFERENCE_ERROR,
                    str(exc) or type(exc).__name__)
        self.deliver(self.dialect.frame_error(exc))

    # --- messages out ---------------------------------------------------------------------

    def send(self, message: Outgoing) -> None:
        """``message`` to the client: through the link, or kept while detached (bounded:
        :class:`ClientNotReading` past ``max_pending_events``)."""
        if self.link is not None:
            self.link.send(message)
            return
        if len(self.pending) >= self.limits.max_pending_events:
            raise ClientNotReading(f"{len(self.pending)} events wait for a transport")
        self.pending.append(message)

    def send_all(self, messages: list[Outgoing]) -> None:
        for message in messages:
            self.send(message)

    # --- transports come and go -------------------------------------------------------------

    def attach(self, link: Link) -> None:
        """Send through ``link`` from now on, the messages made while detached first."""
        if self.released:
            raise RuntimeError(f"{self.session_id} was released")
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.link, self.detached = link, False
        while self.pending:
            link.send(self.pending.popleft())

    def detach(self) -> None:
        """The transport is gone; the session goes on (its slot held, its timers running)
        until a new link attaches or its deadline passes (then it is released)."""
        if self.detached or self.released:
            return
        self.link, self.detached = None, True
        logger.info("%s detached from its transport", self.session_id)
        self._expiry = asyncio.ensure_future(self._expire_detached())

    async def _expire_detached(self) -> None:
        reason = await self.expired()
        logger.info("%s released while detached: %s", self.session_id, reason)
        await self.release()

    # --- clocks and halts -----------------------------------------------------------------

    def active(self) -> None:
        """Audio arrived or a request succeeded: the idle clock restarts."""
        self.last_activity = time.monotonic()

    def deadline(self) -> tuple[float, str]:
        """The next timeout: the update deadline or idle time, capped by the wall-clock limit."""
        if self.keep_alive is not None and self.keep_alive():
            self.active()
        wall = (self.connected_at + self.limits.max_session_wall_seconds,
                f"session open for {self.limits.max_session_wall_seconds:g} s "
                "(--max-session-wall-seconds)")
        if not self.configured:
            due = (self.connected_at + self.limits.update_timeout,
                   f"session.update not received within {self.limits.update_timeout:g} s")
        else:
            due = (self.last_activity + self.limits.idle_timeout,
                   f"session idle for {self.limits.idle_timeout:g} s (no audio and no "
                   "successful request)")
        return min(due, wall)

    async def expired(self) -> str:
        """Return the reason once :meth:`deadline` has passed (activity meanwhile moves it)."""
        while True:
            when, reason = self.deadline()
            delay = when - time.monotonic()
            if delay <= 0:
                return reason
            await asyncio.sleep(delay)

    def halt(self, exc: BaseException) -> None:
        """End the conversation with ``exc`` at its next wait (first call wins); a
        detached session is released."""
        if not self.halted.done():
            self.halted.set_result(exc)
        if self.feed is not None:
            self.feed.halt(exc)
        if self.detached:
            self.spawn(self.release())

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A timer or background step of the session, cancelled when it is released."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- the engine session ------------------------------------------------------------------

    async def open_session(self, options: OpenOptions) -> SessionDetails:
        """Open the engine session (closing one opened before), watching the transport
        while its prompt prefills; a failure is ``session_initialization_failed``."""
        if self.open:
            self.open = False
            await self.engine.close(self.session_id)
        self.configured = False
        self.event_loop, self.frames_run = asyncio.get_running_loop(), 0
        opening = self.engine.open(self.session_id, options, self)
        self.open = True  # the engine may hold a stream from now on: release closes it
        await (self.link.watch(opening) if self.link is not None else self.wait_opening(opening))
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

    async def wait_opening(self, opening: asyncio.Future) -> None:
        """Wait for the engine to open the session with no transport: its prefill is
        stopped at the wall-clock cap."""
        remaining = self.connected_at + self.limits.max_session_wall_seconds - time.monotonic()
        done, _ = await asyncio.wait({opening}, timeout=max(remaining, 0))
        if not done:
            self.engine.abort(self.session_id)
            await asyncio.wait({opening})

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
            if self.halted.done():
                self.feed.halt(self.halted.result())
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
        """:meth:`let_go`, stop the session's timers, then wait for the engine to have
        closed the session. Safe to call again."""
        self.let_go()
        self.released, self.link, self.detached = True, None, False
        current = asyncio.current_task()
        for task in [*self._tasks, self._expiry]:
            if task is not None and task is not current:
                task.cancel()
        closing, self.closing = self.closing, None
        if closing is not None:
            try:
                await closing
            except Exception:
                logger.exception("closing %s failed", self.session_id)
