"""One transport, one dialect and one session, glued: the loop of a realtime conversation.

A :class:`Connection` runs on the event loop: accept, admission, the
dialect's greeting, then client messages until the dialect ends the
conversation (:class:`~.messages.Finished`), a deadline of the session
(close for :attr:`~.messages.Ending.VIOLATION`), a client that stops reading
its events (:attr:`~.messages.Ending.NOT_READING`) or the client leaving.
Each message is size-checked here, parsed (a long one in a worker thread, so
no client's message holds the loop) and acted on by the dialect, and
answered after the audio queued before it (:meth:`~.session.session.Session.settle`).
While one is handled the next is read ahead (not over a transport whose
receive joins queued audio: WebRTC's), so a client that leaves frees its
slot at once, whatever the server was doing.
The session sends through the connection (it is the session's
:class:`~.session.peers.Link`) to the transport, which serializes and closes with
its own codes. Audio payloads are never logged; client values are never
used as paths.

When the transport ends the session is released, unless it outlives it
(:meth:`~.session.session.Session.outlives`: a resumable session whose link dropped
with no close, or one asked to): then it is detached, and a later
connection over a new transport (``Connection(transport, session,
resumed=True, last_seq=N)``) takes it on: the dialect's ``session.resumed``
first, then the events after ``seq`` N, then the conversation goes on. The
dialect's greeting of a resumable session carries its ``session.resume_token``.

:func:`connect` makes a new session with its dialect and the connection that
serves it; the app calls it for each upgrade.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .engine.admission import Slot
from .engine.thread import Engine
from .limits import ServerLimits
from .mcp.manager import McpManager
from .mcp.session_tools import SessionTools
from .messages import (NOT_READING, AudioIn, AudioMark, ClientNotReading, Ending,
                       Finished, Hangup, Outgoing)
from .session.session import Session
from .wire import OFF_LOOP_CHARS, ErrorCode, ProtocolError

if TYPE_CHECKING:  # for the types only
    from .dialects.base import Dialect

logger = logging.getLogger(__name__)


class Transport(Protocol):
    """What a connection needs of a transport (:mod:`.transport`), on the event loop."""

    plays_audio: bool  # it plays the model's audio itself (a WebRTC track), paced
    # Its receive joins what queued meanwhile (a WebRTC track's audio): read only when
    # the connection is ready for the next message, never ahead of it.
    joins_audio: bool

    async def accept(self) -> None: ...

    async def receive(self) -> str | bytes | AudioIn | AudioMark | Hangup:
        """The next client frame (or media audio, or a mark its playback reached), or
        :class:`Hangup` once the client has gone."""

    def send(self, message: Outgoing) -> None:
        """Queue one message (:class:`ClientNotReading` if the client does not read)."""

    def promise(self, messages: list[Outgoing]) -> None:
        """Queue a resume's replay, sent as the client reads: never counted as unread."""

    async def drain(self) -> bool:
        """Let the queued messages go out (``False``: the client did not take them)."""

    async def stop(self) -> None: ...

    async def close(self, ending: Ending, reason: str = "") -> None: ...


class DeadlinePassed(Exception):
    """The session's deadline (no update, idle, the wall clock) passed first: ``reason``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def raised(received: str | bytes | AudioIn | AudioMark | Hangup
           ) -> str | bytes | AudioIn | AudioMark:
    """A transport's read as a message, its :class:`Hangup` raised."""
    if isinstance(received, Hangup):
        raise received
    return received


def connect(transport: Transport, dialect: Callable[[Session, str], Dialect],
            engine: Engine, model_id: str, limits: ServerLimits,
            mcp: McpManager | None = None) -> Connection:
    """A new session spoken in ``dialect`` (a :class:`~.dialects.base.Dialect` class),
    served over ``transport``; with ``mcp``, the operator's MCP tools are its too."""
    session = Session(engine, limits, dialect, model_id)
    if mcp is not None:
        session.server_tools = SessionTools(session, mcp)
    return Connection(transport, session)


class Connection:
    """The loop of one transport over one session, in the session's dialect."""

    def __init__(self, transport: Transport, session: Session, resumed: bool = False,
                 last_seq: int | None = None):
        self.transport = transport
        self.session = session
        self.dialect = session.dialect
        self.limits = session.limits
        self.resumed = resumed  # the session was detached from another transport
        self.last_seq = last_seq  # the last event the client read (resumed: replay after it)
        self.receiving: asyncio.Future | None = None  # a pending transport.receive()
        self.early: deque[Any] = deque()  # messages read while a prefill ran
        self.admitted = False  # its slot was reserved before the transport (a WebRTC call)
        # Resolved when a resume takes the session from this transport (:meth:`supersede`).
        self.letting_go: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def session_id(self) -> str:
        return self.session.session_id

    # --- the session's link -----------------------------------------------------------

    def send(self, message: Outgoing) -> None:
        self.transport.send(message)

    def replay(self, messages: list[Outgoing]) -> None:
        if messages:
            self.transport.promise(messages)

    def inject(self, message: str) -> None:
        """``message`` handled first, as if the client had sent it (a minted session)."""
        self.early.appendleft(message)

    async def watch(self, opening: asyncio.Future) -> None:
        """Wait for the engine to open the session while watching the transport.

        A prefill is the one long engine command: if the client leaves or the
        wall-clock cap passes meanwhile, the prefill is stopped between two
        positions and the slot is freed (a session that outlives its transport
        goes on opening, detached). Messages that arrive meanwhile are kept, in
        order, for the loop.
        """
        session = self.session
        while not opening.done():
            self.receive()
            remaining = session.connected_at + self.limits.max_session_wall_seconds \
                - time.monotonic()
            done, _ = await asyncio.wait({opening, self.receiving, self.letting_go},
                                         timeout=max(remaining, 0),
                                         return_when=asyncio.FIRST_COMPLETED)
            if self.superseded:  # the session goes on opening for the resume that took it
                await session.wait_opening(opening)
                return
            gone = self.receiving in done and isinstance(self.receiving.result(), Hangup)
            if gone and session.outlives(self.receiving.result()):
                self.early.append(self.receiving.result())
                self.receiving = None
                await session.wait_opening(opening)
                return
            if not done or gone:
                session.engine.abort(self.session_id)
                await asyncio.wait({opening})
                if done:
                    raise self.receiving.result()
                return  # the deadline: the loop reports it
            if self.receiving in done:
                self.early.append(self.receiving.result())
                self.receiving = None

    @property
    def superseded(self) -> bool:
        return self.letting_go.done()

    def supersede(self) -> None:
        """A resume took the session (:meth:`.resume.Resumes.take_over`): read nothing
        more from this transport, never detach or release the session from here, and
        let :meth:`run` close the transport."""
        if self.receiving is not None:
            self.receiving.cancel()
            self.receiving = None
        if not self.letting_go.done():
            self.letting_go.set_result(None)

    # --- lifetime -----------------------------------------------------------------

    def _hung_up(self, receiving: asyncio.Future) -> None:
        """Done callback of every receive: a hangup frees the slot at once.

        The WebSocket layer answers a client's close frame in the same step as
        it queues the disconnect, so the client may call again (its close
        handshake complete) before this task resumes. This callback runs
        straight after the receive completes, before the newcomer's upgrade
        reaches the application, so the newcomer finds the slot free. A session
        that outlives its transport is detached instead.
        """
        if self.superseded or receiving.cancelled() or receiving.exception() is not None \
                or not isinstance(receiving.result(), Hangup):
            return
        session = self.session
        if session.outlives(receiving.result()):
            session.detach()
        elif session.opening_or_open and not session.is_open:
            session.free_slot()  # a prefill in flight: watch() stops it
        else:
            session.let_go()

    def receive(self) -> asyncio.Future:
        """The pending ``transport.receive()`` (started if none is), kept across awaits."""
        if self.receiving is None:
            self.receiving = asyncio.ensure_future(self.transport.receive())
            self.receiving.add_done_callback(self._hung_up)
        return self.receiving

    async def finish(self, ending: Ending, reason: str = "") -> None:
        """Free the session, let queued events go out (bounded), then close."""
        await self.session.release()
        if not await self.transport.drain():
            ending, reason = Ending.NOT_READING, NOT_READING
        await self.transport.stop()
        await self.close(ending, reason)

    async def close(self, ending: Ending, reason: str = "") -> None:
        """Close the transport for ``ending`` (best effort)."""
        await self.transport.close(ending, reason)

    # --- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        session, engine = self.session, self.session.engine
        try:
            await self.transport.accept()
        except BaseException:
            session.unclaim()  # a resume that never reached its client
            raise
        self.dialect.plays_audio = self.transport.plays_audio
        try:
            if self.resumed:
                replayed = session.replay.seq - (self.last_seq if self.last_seq is not None
                                                 else session.replay.detached_after or 0)
                self.send(self.dialect.resumed(self.last_seq or 0, replayed))
                session.attach(self, self.last_seq)
                if session.watcher is not None:  # counted once the session is attached
                    session.watcher.resumed(session)
                logger.info("%s resumed on a new transport (%d events replayed)",
                            self.session_id, replayed)
            else:
                session.attach(self)
                if not engine.ready:
                    self.dialect.send_error(ErrorCode.SERVER_BUSY, "the model is not loaded")
                    raise Finished(Ending.BUSY)
                if not self.admitted:
                    slot = await engine.admission.accept(self.session_id)
                    if slot is Slot.REFUSED:
                        self.dialect.send_error(ErrorCode.SERVER_BUSY, engine.admission.refusal)
                        raise Finished(Ending.BUSY)
                    session.slot_pending = slot is Slot.DEFERRED  # taken when it opens
                logger.info("%s connected", self.session_id)
                greeting = self.dialect.greet()
                if greeting is not None:  # a dialect whose client speaks first has none
                    session.send(greeting)
            await self.loop()
        except (Finished, Hangup) as end:
            if self.superseded:  # the session goes on with the resume that took it
                logger.info("%s: the old transport closes (resumed on another)",
                            self.session_id)
                await self.transport.stop()
                await self.close(Ending.SUPERSEDED, "the session was resumed on another "
                                                    "connection")
            elif isinstance(end, Finished):
                await self.finish(end.ending)
            else:
                logger.info("%s disconnected", self.session_id)
        except ClientNotReading as exc:
            logger.info("%s closed: %s (%s)", self.session_id, NOT_READING, exc)
            await session.release()
            await self.transport.stop()
            await self.close(Ending.NOT_READING, NOT_READING)
        finally:
            if self.receiving is not None:
                self.receiving.cancel()
            # A hangup detached one that outlives its transport; a superseded
            # transport's session belongs to the resume that took it.
            if not (session.detached_or_claimed or self.superseded):
                await session.release()
            await self.transport.stop()

    async def loop(self) -> None:
        """Client messages, one at a time, until :class:`Finished` or the client leaves."""
        while True:
            try:
                message = await self.next_message()  # raises Hangup once the client left
            except DeadlinePassed as passed:
                logger.info("%s timed out: %s", self.session_id, passed.reason)
                self.session.send(self.dialect.timed_out(passed.reason))
                raise Finished(Ending.VIOLATION) from None
            if isinstance(message, AudioMark):
                self.dialect.played(message)  # the transport's playback reached it
                continue
            # Read on while the message is handled: a client that leaves meanwhile
            # frees its slot at once (:meth:`_hung_up`), not once the handling ends.
            if not self.transport.joins_audio:
                self.receive()
            try:
                async with self.session.acting:
                    await self.handle(message)
            except ProtocolError as exc:
                self.dialect.send_error(exc.code, exc.message)
                self.dialect.refused(exc)  # the dialect's rule: may end the conversation

    def checked(self, message: str | bytes) -> str | bytes:
        """A client message within ``max_message_bytes``."""
        size = len(message.encode("utf-8", "surrogatepass")) if isinstance(message, str) \
            else len(message)
        if size > self.limits.max_message_bytes:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"message of {size} bytes exceeds the "
                                f"{self.limits.max_message_bytes}-byte limit")
        return message

    async def handle(self, raw: str | bytes | AudioIn) -> None:
        """One message: checked, parsed by the dialect, answered after the audio before it."""
        session = self.session
        try:
            if isinstance(raw, AudioIn):
                message = self.dialect.audio_in(raw)
            elif len(self.checked(raw)) > OFF_LOOP_CHARS:
                message = await asyncio.to_thread(self.dialect.parse, raw)
            else:
                message = self.dialect.parse(raw)
        except ProtocolError:
            await session.settle()
            raise
        audio = self.dialect.queues_audio(message)
        if not audio:
            await session.settle()
        try:
            await self.dialect.dispatch(message)
        except ProtocolError:
            if audio:  # its error goes out after the events of the audio before it
                await session.settle()
            raise

    async def next_message(self) -> str | bytes | AudioIn | AudioMark:
        """The next client message (a frame, media audio, a mark its playback reached);
        kept ones first. Raises :class:`Hangup` once the client has gone (or a resume
        took the session), :class:`DeadlinePassed` when the session's deadline passed
        first, and what halted the session (e.g. :class:`ClientNotReading` met while
        forwarding a frame's events) as soon as it happens. A message already there is
        taken even when the deadline has passed meanwhile.
        """
        if self.superseded:
            raise Hangup(None)
        if self.early:
            return raised(self.early.popleft())
        receiving, halted = self.receive(), self.session.halted
        expiry = asyncio.ensure_future(self.session.expired())
        try:
            if not (halted.done() or receiving.done()):
                await asyncio.wait({receiving, halted, expiry, self.letting_go},
                                   return_when=asyncio.FIRST_COMPLETED)
            else:  # read ahead: the engine's hand-offs queued meanwhile go first
                await asyncio.sleep(0)
        finally:
            expiry.cancel()
        if self.superseded:
            raise Hangup(None)
        if halted.done():
            raise halted.result()
        if not receiving.done():
            raise DeadlinePassed(expiry.result())
        self.receiving = None
        return raised(receiving.result())
