"""One realtime session: its engine side, its dialect's state and its clocks, in no transport.

A :class:`Session` runs on the event loop. It opens the engine session
(:meth:`~Session.open_session`, with the typed options its dialect built:
:mod:`..dialects.client_options`), hands audio to the bounded
:class:`~..engine.feed.InputFeed`, queues markers behind it
(:meth:`~Session.settle`, tool results): dialects reach the engine only through
its calls, each failure the client's error (``session_initialization_failed``,
``server_busy``, ``inference_error``). It is the engine's sink: once per
engine cycle it is handed how late the frames ran, their runtime events, a
frame's error and its markers' replies (:meth:`~Session.on_handoff`), which its
dialect (:attr:`~Session.dialect`, :mod:`..dialects`) turns into typed messages
(:mod:`..messages`) for the attached :class:`Link` (a connection, over a
transport), numbered and kept a while (:mod:`.replay`). A resumable session
outlives a link that dropped or that a resume takes (:mod:`.resume`), as one
asked to (:meth:`~Session.outlives`): detached (:meth:`~Session.detach`: slot
held, events kept, timeline paused, :attr:`~Session.linked` cleared) until
:meth:`~Session.attach` gives it a new link, or its window, deadline or the
replica's drain ends it. Released on every exit path (:meth:`~Session.release`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Coroutine

import numpy as np

from ...runtime.options import ConversationOptions
from ...runtime.pool import PoolFull
from ...runtime.streaming import ContextLimit, TranscriptLimit
from ...runtime.tool_failures import DEFAULT_MAX_RESULT_BYTES
from ..engine.channel import Handoff
from ..engine.commands import Close, OpenOptions, SessionDetails
from ..engine.feed import InputFeed
from ..engine.pace import FramePace
from ..engine.thread import Engine
from .lifecycle import Lifecycle, Stage, Tie
from ..limits import ServerLimits
from .client_calls import ClientCalls
from ..mcp.session_tools import SessionTools
from ..messages import ClientNotReading, Hangup, Outgoing
from .peers import Link, Watcher
from .replay import ReplayLog
from ..wire import ErrorCode, ProtocolError, inference_error, init_failed, new_session_id

if TYPE_CHECKING:  # the dialects sit above the session: named here for the types only
    from ..dialects.base import Dialect

logger = logging.getLogger(__name__)

# A transport's end with no close from the client (a WebSocket's 1006): the link dropped.
DROPPED_CODES = (1006, None)
# Frames of one second (the model's frames are 80 ms), for the replay's bound.
FRAMES_PER_SECOND = 12.5
# Why a detached session ended when a connection that found the server full took its slot.
SLOT_TAKEN = "its slot was given to a new connection (the server was full)"


def stream_full(exc: BaseException) -> bool:
    """Whether a frame's error is its stream reaching ``max_streaming_seconds`` (no byte cap)."""
    return isinstance(exc, ContextLimit) and not isinstance(exc, TranscriptLimit)


def abandon(future: asyncio.Future) -> None:
    """Take ``future``'s outcome, now or when it comes, for nobody: its caller left."""
    def taken(done: asyncio.Future) -> None:
        if not done.cancelled():
            done.exception()

    if future.done():
        taken(future)
    else:
        future.add_done_callback(taken)


class Session:
    """One client's session in the engine, with or without a transport attached."""

    def __init__(self, engine: Engine, limits: ServerLimits,
                 dialect: "Callable[[Session, str], Dialect]", model_id: str):
        """A new session, spoken in ``dialect`` (a :class:`~..dialects.base.Dialect` class,
        built here for this session) serving ``model_id``."""
        self.engine = engine
        self.limits = limits
        self.session_id = new_session_id()
        self.life = Lifecycle(self.session_id)  # its two states: moved only here
        self.tools_set = False
        self.closing: asyncio.Future | None = None  # the engine's close, once queued
        self.details: SessionDetails | None = None  # of the open session
        self.feed: InputFeed | None = None  # the session's input queue, from the first audio
        self.event_loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        self.frames_run = 0  # frames of the session whose events were handed over
        self.connected_at = time.monotonic()
        self.last_activity = self.connected_at  # last audio or successful request
        self._keep_alive: Callable[[], bool] | None = None  # while true, idle time stops
        # One thing acts on the session at a time: a client message, a timer's step.
        self.acting = asyncio.Lock()
        # Resolves with the exception that ends the conversation (a client not
        # reading, a full stream): the connection raises it at its next wait.
        self.halted: asyncio.Future = self.event_loop.create_future()
        self.link: Link | None = None
        self.linked = asyncio.Event()  # set while a link is attached (timers wait for it)
        self._outlives_transport = False  # detach, not release, when the transport ends
        self.resume_token: str | None = None  # set when resumable: a dropped link detaches
        self.detached_at = 0.0  # when its transport ended
        self.replay = ReplayLog(limits.max_replay_seconds * FRAMES_PER_SECOND,
                                max_bytes=limits.max_replay_bytes)
        self.frames_seen = 0  # frames whose events were handed over, never reset
        self.pace = FramePace()  # how late the session's frames ran, all of them
        self.samples_received = 0  # client audio taken, at the rate the client sends it
        self.received_at_open = 0  # samples_received when the engine stream last opened
        self.ended = ""  # why a detached session was released (not resumed)
        # Connected while detached sessions held every slot: it takes one of theirs only
        # once it opens (configured, or sending audio), :meth:`open_session`.
        self.slot_pending = False
        self.watcher: Watcher | None = None  # told when it detaches and is released
        self._tasks: set[asyncio.Task] = set()
        self._expiry: asyncio.Task | None = None  # a detached session's deadline
        self.server_tools: SessionTools | None = None  # the tools the server runs (MCP)
        self.client_calls = ClientCalls(self, limits.tool_timeout)  # the tools the client runs
        self.dialect: "Dialect" = dialect(self, model_id)

    # --- its states, read (moved only by the methods below) ----------------------------

    @property
    def opening_or_open(self) -> bool:
        """Stage OPENING or OPEN: the engine may hold its stream, a release closes it."""
        return self.life.stage in (Stage.OPENING, Stage.OPEN)

    @property
    def is_open(self) -> bool:
        """Stage OPEN: the engine holds its open stream (a completed ``session.update``)."""
        return self.life.stage is Stage.OPEN

    @property
    def detached_or_claimed(self) -> bool:
        """Tie DETACHED or CLAIMED: its transport ended and it awaits a resume."""
        return self.life.tie in (Tie.DETACHED, Tie.CLAIMED)

    @property
    def claimed(self) -> bool:
        """Tie CLAIMED: a resume of it is being accepted, another is refused."""
        return self.life.tie is Tie.CLAIMED

    @property
    def released(self) -> bool:
        """Tie RELEASED: ended, no transport will carry it again."""
        return self.life.tie is Tie.RELEASED

    # --- what its makers ask of it, once -------------------------------------------------

    def make_resumable(self, token: str, watcher: Watcher) -> None:
        """Resumable under ``token``: a link that drops detaches it, its events are
        numbered, and ``watcher`` hears of its detaches, resumes and release."""
        self.resume_token, self.watcher = token, watcher
        self.replay.numbered = True

    def outlive_transports(self) -> None:
        """Detach, never release, when a transport ends (whatever its close)."""
        self._outlives_transport = True

    def keep_alive_while(self, busy: Callable[[], bool]) -> None:
        """While ``busy()`` (a GA response owed), idle time does not count."""
        self._keep_alive = busy

    # --- its calls into the engine (each failure the client's error) --------------------

    async def open_session(self, options: OpenOptions) -> SessionDetails:
        """Open the engine session (closing one opened before), watching the transport
        while its prompt prefills; a failure is ``session_initialization_failed``."""
        if self.life.stage in (Stage.CLOSING, Stage.CLOSED):  # its client left meanwhile
            raise init_failed("the session is closing")
        if self.server_tools is not None:  # the server's tools beside the session's
            options = self.server_tools.offer(options)
        if self.opening_or_open:  # opened before: closed, to be opened again
            self.client_calls.forget()
            self.life.move_engine(Stage.NEW)
            await self.engine.close(self.session_id)
        if self.slot_pending:  # admitted while only detached sessions held the slots
            admission = self.engine.admission
            if not await admission.reserve(self.session_id):
                raise ProtocolError(ErrorCode.SERVER_BUSY, admission.refusal)
            self.slot_pending = False
        self.event_loop, self.frames_run = asyncio.get_running_loop(), 0
        self.received_at_open = self.samples_received
        opening = self.engine.open(self.session_id, options, self)
        self.life.move_engine(Stage.OPENING)  # the engine may hold a stream: release closes it
        try:
            await (self.link.watch(opening) if self.link is not None
                   else self.wait_opening(opening))
        except BaseException:
            # The client left (or the task was cancelled) while it opened: the open's
            # outcome (a stopped prefill's PrefillCancelled) is ours to take, not the
            # garbage collector's to log as never retrieved.
            abandon(opening)
            raise
        try:
            details = opening.result()
        except PoolFull as exc:  # its reservation does not fit --max-state-bytes
            raise ProtocolError(ErrorCode.SERVER_BUSY, str(exc)) from None
        except Exception as exc:
            raise init_failed(str(exc)) from None
        if self.life.stage is not Stage.OPENING:  # let go meanwhile: its close is queued
            raise init_failed("the session was closed while it opened")
        self.life.move_engine(Stage.OPEN)
        self.tools_set = isinstance(options, ConversationOptions) and options.tools is not None
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

    async def feed_audio(self, samples: np.ndarray, sent: int | None = None) -> None:
        """Client audio at the session's input rate, queued (not awaited: its frames run
        in batched steps with the other sessions' and their events come back in order);
        the session counts as active. ``sent``: the samples the client sent for it, at
        the rate it sends (by default ``samples`` themselves), counted here, once, in
        :attr:`samples_received` (a resume's figure, NVIDIA's ``session.end``)."""
        self.samples_received += samples.shape[0] if sent is None else sent
        if not samples.shape[0]:
            return
        self.active()
        await self.input_feed().append(samples)

    @property
    def heard_since_open(self) -> bool:
        """Whether the engine stream took input since it opened: client audio, or frames
        run (the server's silence too)."""
        return self.frames_run > 0 or self.samples_received > self.received_at_open

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
        """A tool result: its tokens enter the timeline at the next frames. One over the
        result bound reaches the model as a ``too_large`` failure and is the client's
        ``tool_call_failed``; one after its call timed out is refused."""
        if not self.tools_set:
            raise ProtocolError(ErrorCode.TOOLS_NOT_SET,
                                "function_call_output needs tools registered in session.update")
        if self.server_tools is not None and self.server_tools.runs(call_id):
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"tool call {call_id} is run by the server; it takes no "
                                "function_call_output")
        max_bytes = (self.server_tools.manager.max_result_bytes if self.server_tools is not None
                     else DEFAULT_MAX_RESULT_BYTES)
        output, failure = self.client_calls.answer(call_id, output, max_bytes)
        try:
            await self.engine.tool_result(self.session_id, call_id, output)
        except ValueError as exc:  # unknown / answered call_id, non-ASCII output
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        except Exception as exc:
            raise inference_error(exc) from None
        if failure is not None:
            raise ProtocolError(ErrorCode.TOOL_CALL_FAILED, f"tool call {call_id}: {failure}")

    async def flush(self, pad_partial: bool = True) -> list:
        """Run the audio queued so far (the partial frame padded, if asked) and end the
        turn; its runtime events (an engine failure is the client's ``inference_error``)."""
        return await self.engine_call(self.engine.flush(self.session_id, pad_partial))

    async def cancel(self) -> list:
        """Drop the audio queued and cancel the response; its runtime events."""
        return await self.engine_call(self.engine.cancel(self.session_id))

    async def push(self, samples: np.ndarray) -> None:
        """One frame of server-made input (silence), queued behind the client's audio;
        waits for it to run (its events come as any frame's)."""
        await self.engine_call(self.engine.push(self.session_id, samples))

    @property
    def client_metrics(self) -> Any:
        """The engine's per-client figures (``/metrics``), or ``None``."""
        return getattr(self.engine.metrics, "clients", None)

    async def engine_call(self, call: Any) -> Any:
        """Await an engine command; its failure is the client's ``inference_error``."""
        try:
            return await call
        except Exception as exc:
            raise inference_error(exc) from None

    # --- the engine's hand-offs (on the loop) ------------------------------------------

    def on_handoff(self, handoff: Handoff) -> None:
        """One engine cycle's output (on the loop): how late its frames ran, then in order
        a frame's events (translated here), a frame's error, a marker's reply."""
        if handoff.consumed and self.feed is not None:  # the client's audio, still worked on:
            self.feed.consumed(handoff.consumed)  # not idle (a backlog on a slow server)
            self.active()
        if handoff.pace.frames:
            self.pace.add(handoff.pace)
            self.dialect.paced(handoff.pace)
        for entry in handoff.entries:
            entry.apply(self)  # on_frame, frame_error, or a marker's reply resolved

    def on_frame(self, events: list) -> None:
        """One frame's runtime events, translated by the dialect and sent."""
        self.frames_run += 1
        self.frames_seen += 1
        if self.server_tools is not None:
            events = self.server_tools.observe(events)
        self.client_calls.observe(events)
        self.deliver(self.dialect.translate(events))

    def deliver(self, messages: list[Outgoing]) -> None:
        """The engine's messages (on the loop), in order; a client not reading halts it."""
        try:
            self.send_all(messages)
        except ClientNotReading as exc:
            self.halt(exc)

    def frame_error(self, exc: BaseException) -> None:
        """A queued frame failed (the rest of its append is dropped): the dialect says so."""
        self.dialect.log_error(ErrorCode.INFERENCE_ERROR, str(exc) or type(exc).__name__)
        self.deliver(self.dialect.frame_error(exc))

    # --- messages out ---------------------------------------------------------------------

    def send(self, message: Outgoing) -> None:
        """``message`` to the client, numbered: through the link, or kept while detached
        (bounded: past ``--max-replay-seconds`` or ``--max-replay-bytes`` the session
        ends)."""
        if self.released:
            return
        message = self.replay.stamp(message, self.frames_seen, self.link is not None)
        if self.link is not None:
            self.link.send(message)
        elif self.replay.overflowed:
            self.end_detached(f"its events while detached passed "
                              f"{self.limits.max_replay_seconds:g} s (--max-replay-seconds) "
                              f"or {self.limits.max_replay_bytes} bytes (--max-replay-bytes)")

    def send_all(self, messages: list[Outgoing]) -> None:
        for message in messages:
            self.send(message)

    # --- transports come and go -------------------------------------------------------------

    def outlives(self, hangup: Hangup) -> bool:
        """Whether the transport's end ``hangup`` detaches the session (asked to outlive
        it, or resumable, configured once and the link dropped with no close) instead of
        ending it. A session never configured has nothing to resume: it ends at once."""
        return self._outlives_transport or (
            self.resume_token is not None and self.details is not None
            and hangup.code in DROPPED_CODES)

    def attach(self, link: Link, last_seq: int | None = None) -> None:
        """Send through ``link`` from now on, the events after ``last_seq`` first (by
        default those made while detached)."""
        if self.released:
            raise RuntimeError(f"{self.session_id} was released")
        if self.life.tie is Tie.ATTACHED:
            self.life.move_link(Tie.ATTACHED)  # refused: another link carries it
        replayed = self.replay.after(last_seq)
        if replayed is None:
            raise RuntimeError(f"{self.session_id} no longer holds the events after "
                               f"seq {last_seq}")
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.life.move_link(Tie.ATTACHED)
        self.link = link
        self.linked.set()
        self.active()  # the idle clock starts again with the new link
        link.replay(replayed)

    def detach(self) -> None:
        """The transport is gone; the session goes on (its slot held, its queued audio
        running, its dialect's timers waiting for :attr:`linked`) until a new link
        attaches or its window or deadline passes (then it is released)."""
        if self.life.tie is not Tie.ATTACHED:
            return  # already detached or released (or never attached: nothing to keep)
        self.life.move_link(Tie.DETACHED)
        self.link, self.detached_at = None, time.monotonic()
        self.linked.clear()
        self.replay.detach()
        logger.info("%s detached from its transport", self.session_id)
        if self.watcher is not None:
            self.watcher.detached(self)
        if self.engine.admission.draining:
            self.end_detached("the server is draining")
            return
        self._expiry = asyncio.ensure_future(self._expire_detached())

    def claim(self) -> None:
        """A resume of this detached session is being accepted (another is refused)."""
        self.life.move_link(Tie.CLAIMED)

    def unclaim(self) -> None:
        """The resume being accepted never reached its client: detached again."""
        if self.claimed:
            self.life.move_link(Tie.DETACHED)

    def end_detached(self, reason: str) -> None:
        """Release a detached session (not resumed) for ``reason``: its slot is free at
        once (:meth:`let_go`), the rest of the release follows."""
        if self.released or self.ended:
            return
        self.ended = reason
        logger.info("%s released while detached: %s", self.session_id, reason)
        self.let_go()
        self.spawn(self.release())

    def window(self) -> tuple[float, str]:
        """When a detached session's wait ends: its window (``--resume-seconds``; the
        session's deadline alone when it is not resumable) or its deadline."""
        due, seconds = self.deadline(), self.limits.resume_seconds
        if self.resume_token is None:
            return due
        return min(due, (self.detached_at + seconds,
                         f"not resumed within {seconds:g} s (--resume-seconds)"))

    async def _expire_detached(self) -> None:
        reason = await self.expired(self.window)
        self._expiry = None
        self.end_detached(reason)

    # --- clocks and halts -----------------------------------------------------------------

    def active(self) -> None:
        """Audio arrived or was taken into a frame, or a request succeeded: idle from now."""
        self.last_activity = time.monotonic()

    def deadline(self) -> tuple[float, str]:
        """The next timeout: the update deadline or idle time, capped by the wall-clock limit."""
        if self._keep_alive is not None and self._keep_alive():
            self.active()
        wall = (self.connected_at + self.limits.max_session_wall_seconds,
                f"session open for {self.limits.max_session_wall_seconds:g} s "
                "(--max-session-wall-seconds)")
        if not self.is_open:
            due = (self.connected_at + self.limits.update_timeout,
                   f"session.update not received within {self.limits.update_timeout:g} s")
        else:
            due = (self.last_activity + self.limits.idle_timeout,
                   f"session idle for {self.limits.idle_timeout:g} s (no audio and no "
                   "successful request)")
        return min(due, wall)

    async def expired(self, deadline: Callable[[], tuple[float, str]] | None = None) -> str:
        """Return the reason once :meth:`deadline` (or ``deadline``) has passed (activity
        meanwhile moves it)."""
        while True:
            when, reason = (deadline or self.deadline)()
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
        if self.detached_or_claimed:
            self.end_detached(str(exc) or type(exc).__name__)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A timer or background step of the session, cancelled when it is released."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
    # --- release ---------------------------------------------------------------------------

    def free_slot(self) -> None:
        """The transport ended while the engine session opens (its prefill is being
        stopped): the slot is free at once for whoever connects meanwhile; the engine
        runs its commands in order, so the newcomer's open follows this one's end."""
        self.engine.admission.free(self.session_id)

    def let_go(self) -> None:
        """Queue the engine's close (cancelling unflushed audio), then free the slot, now:
        the engine runs its commands in order, so a client reconnecting at once is admitted
        and its session opens after this one is gone. Safe to call again."""
        if self.opening_or_open:
            if self.life.stage is Stage.OPENING:  # its prefill stops between positions
                self.engine.abort(self.session_id)
            self.life.move_engine(Stage.CLOSING)
            self.closing = self.engine.submit(Close(self.session_id))
        self.engine.admission.free(self.session_id)

    async def release(self) -> None:
        """:meth:`let_go`, stop the session's timers, then wait for the engine to have
        closed the session. Safe to call again."""
        self.let_go()
        if not self.released and self.watcher is not None:
            self.watcher.released(self)
        if not self.released:
            self.life.move_link(Tie.RELEASED)
        self.link = None
        self.replay.clear()
        if self.server_tools is not None:  # its calls cancelled, its own MCP servers closed
            try:
                await self.server_tools.close()
            except Exception:
                logger.exception("closing %s's MCP servers failed", self.session_id)
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
        if self.life.stage is not Stage.CLOSED:
            self.life.move_engine(Stage.CLOSED)
