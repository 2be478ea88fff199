"""One client's realtime conversation: the loop between a WebSocket and the engine, in no dialect.

A connection runs: accept, admission, its dialect's greeting, then client
frames until the dialect ends it (:class:`Finished`), a timeout (close 1008),
a client that stops reading its events (close 1008, ``client is not
reading``) or the client leaving. Events go out through a bounded
:class:`~.outbox.Outbox`; audio goes in through a bounded
:class:`~.feed.InputFeed`. Audio payloads are never logged; client values
are never used as paths.

The connection is the socket side; its engine side (the session, audio,
markers, the engine's hand-offs, translated here by the dialect) is
:class:`~.engine_session.EngineSession`, its base.

A dialect (:mod:`.dialects`) is a :class:`Connection` subclass that
implements the hooks (:meth:`~Connection.greeting`,
:meth:`~Connection.error_payload`, :meth:`~Connection.parse`,
:meth:`~Connection.queues_audio`, :meth:`~Connection.dispatch`,
:meth:`~Connection.translate`, optionally :meth:`~Connection.limit_reached`)
and uses the shared services: the engine session
(:meth:`~Connection.open_session` with typed options from :mod:`.options`), audio
(:meth:`~Connection.feed_audio`), tool results, ordering
(:meth:`~Connection.settle`) and sending. The app serves it as a
:class:`Dialect`: its paths and its connection class.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from .engine.thread import Engine
from .engine_session import EngineSession
from .limits import ServerLimits
from .transport.outbox import NOT_READING, ClientNotReading, Outbox
from .wire import CloseCode, ErrorCode, ProtocolError, dumps

logger = logging.getLogger(__name__)


class Finished(Exception):
    """Ends the connection from a handler (or a halted input feed): close with ``code``."""

    def __init__(self, code: int = CloseCode.NORMAL):
        super().__init__(code)
        self.code = code



class Connection(EngineSession):
    """One client's conversation with the engine; a dialect implements the hooks."""

    def __init__(self, websocket: WebSocket, engine: Engine, model_id: str,
                 limits: ServerLimits):
        super().__init__(engine, limits)
        self.ws = websocket
        self.model_id = model_id
        self.connected_at = time.monotonic()
        self.last_activity = self.connected_at  # last audio or successful request
        self.failed_updates = 0
        self.receiving: asyncio.Future | None = None  # a pending ws.receive()
        self.early: deque[dict[str, Any]] = deque()  # frames read while a prefill ran
        self.outbox = Outbox(websocket, limits.max_pending_events)
        self.subprotocol: str | None = None  # selected at accept (a browser's "realtime")

    # --- the dialect's hooks ----------------------------------------------------

    def greeting(self) -> dict[str, Any]:
        """The first event, sent once the connection is admitted."""
        raise NotImplementedError

    def error_payload(self, code: str, message: str) -> dict[str, Any]:
        """The dialect's ``error`` event for ``code`` (an :class:`~.wire.ErrorCode`)."""
        raise NotImplementedError

    def parse(self, text: str) -> Any:
        """One client text frame -> the dialect's message (:class:`ProtocolError` if bad)."""
        raise NotImplementedError

    def queues_audio(self, message: Any) -> bool:
        """Whether ``message`` carries audio: queued, not awaited; anything else is
        answered after the audio queued before it has run (:meth:`settle`)."""
        raise NotImplementedError

    async def dispatch(self, message: Any) -> None:
        """Act on one message; raise :class:`Finished` to end the connection."""
        raise NotImplementedError

    def translate(self, events: list) -> list[str]:
        """One frame's (or a command's) runtime events as the texts sent, in order."""
        raise NotImplementedError

    def limit_reached(self) -> None:
        """A frame failed at ``max_streaming_seconds`` (after its error went out); by
        default the connection goes on (the client ends the stream)."""

    # --- sending ----------------------------------------------------------------

    async def send(self, payload: dict[str, Any]) -> None:
        self.outbox.put(dumps(payload))

    async def send_all(self, payloads: list[dict[str, Any]]) -> None:
        for payload in payloads:
            await self.send(payload)

    async def send_error(self, code: str, message: str) -> None:
        logger.info("%s error %s: %s", self.session_id, code, message)
        await self.send(self.error_payload(code, message))

    async def forward(self, events: list) -> None:
        """Runtime events an engine command replied with (a commit's, a cancel's), sent."""
        await self.send_texts(self.translate(events))

    async def send_texts(self, texts: list[str]) -> None:
        for text in texts:
            self.outbox.put(text)

    # --- the socket while the session opens ------------------------------------------

    async def watch(self, opening: asyncio.Future) -> None:
        """Wait for the engine to open the session while watching the socket.

        A prefill is the one long engine command: if the client leaves or the
        wall-clock cap passes meanwhile, the prefill is stopped between two
        positions and the slot is freed. Messages that arrive meanwhile are
        kept, in order, for the loop.
        """
        while not opening.done():
            self.receive()
            remaining = self.connected_at + self.limits.max_session_wall_seconds \
                - time.monotonic()
            done, _ = await asyncio.wait({opening, self.receiving}, timeout=max(remaining, 0),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done or (self.receiving in done and
                            self.receiving.result()["type"] == "websocket.disconnect"):
                self.engine.abort(self.session_id)
                await asyncio.wait({opening})
                if done:
                    raise WebSocketDisconnect(self.receiving.result().get("code", 1000))
                return  # the deadline: the loop reports it
            if self.receiving in done:
                self.early.append(self.receiving.result())
                self.receiving = None

    # --- lifetime -----------------------------------------------------------------

    def _hung_up(self, receiving: asyncio.Future) -> None:
        """Done callback of every receive: a disconnect frees the slot at once.

        The WebSocket layer answers a client's close frame in the same step as
        it queues the disconnect, so the client may call again (its close
        handshake complete) before this task resumes. This callback runs
        straight after the receive completes, before the newcomer's upgrade
        reaches the application, so the newcomer finds the slot free.
        """
        if receiving.cancelled() or receiving.exception() is not None \
                or receiving.result()["type"] != "websocket.disconnect":
            return
        if self.open and not self.configured:
            return  # a prefill in flight: watch() stops it, then the slot is freed
        self.let_go()

    def receive(self) -> asyncio.Future:
        """The pending ``ws.receive()`` (started if none is), kept across awaits."""
        if self.receiving is None:
            self.receiving = asyncio.ensure_future(self.ws.receive())
            self.receiving.add_done_callback(self._hung_up)
        return self.receiving

    async def finish(self, code: int, reason: str = "") -> None:
        """Free the session, let queued events go out (bounded), then close."""
        await self.release()
        if not await self.outbox.drain(self.limits.send_timeout):
            code, reason = CloseCode.POLICY_VIOLATION, NOT_READING
        await self.outbox.stop()
        await self.close(code, reason)

    async def close(self, code: int, reason: str = "") -> None:
        """Best effort: a client that reads nothing never takes the close frame."""
        try:
            await asyncio.wait_for(self.ws.close(code=code, reason=reason),
                                   self.limits.send_timeout)
        except (asyncio.TimeoutError, Exception) as exc:
            logger.info("%s close %d not delivered (%s)", self.session_id, code,
                        type(exc).__name__)

    def deadline(self) -> tuple[float, str]:
        """The next timeout: the update deadline or idle time, capped by the wall-clock limit."""
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

    def active(self) -> None:
        """Audio arrived or a request succeeded: the idle clock restarts."""
        self.last_activity = time.monotonic()

    # --- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        await self.ws.accept(subprotocol=self.subprotocol)
        self.outbox.start()
        try:
            if not self.engine.ready:
                await self.send_error(ErrorCode.SERVER_BUSY, "the model is not loaded")
                raise Finished(CloseCode.TRY_AGAIN_LATER)
            if not self.engine.admission.try_reserve(self.session_id):
                await self.send_error(ErrorCode.SERVER_BUSY, self.engine.admission.refusal)
                raise Finished(CloseCode.TRY_AGAIN_LATER)
            logger.info("%s connected", self.session_id)
            await self.send(self.greeting())
            await self.loop()
        except Finished as end:
            await self.finish(end.code)
        except WebSocketDisconnect:
            logger.info("%s disconnected", self.session_id)
        except ClientNotReading as exc:
            logger.info("%s closed: %s (%s)", self.session_id, NOT_READING, exc)
            await self.release()
            await self.outbox.stop()
            await self.close(CloseCode.POLICY_VIOLATION, NOT_READING)
        finally:
            if self.receiving is not None:
                self.receiving.cancel()
            await self.release()
            await self.outbox.stop()

    async def loop(self) -> None:
        """Client frames, one at a time, until :class:`Finished` or the client leaves."""
        while True:
            deadline, reason = self.deadline()
            try:
                message = await self.next_message(max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                await self.send_error(ErrorCode.INVALID_REQUEST, reason)
                raise Finished(CloseCode.POLICY_VIOLATION) from None
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            try:
                await self.handle(message)
            except ProtocolError as exc:
                await self.send_error(exc.code, exc.message)
                if exc.code == ErrorCode.SESSION_INITIALIZATION_FAILED:
                    self.failed_updates += 1
                    if self.failed_updates >= self.limits.max_failed_updates:
                        await self.send_error(ErrorCode.INVALID_REQUEST,
                                              f"{self.failed_updates} failed session.update "
                                              "messages; closing")
                        raise Finished(CloseCode.POLICY_VIOLATION) from None

    def text_of(self, message: dict[str, Any]) -> str:
        text = message.get("text")
        if text is None:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                "binary frames are not supported; send JSON text")
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_message_bytes:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"message of {size} bytes exceeds the "
                                f"{self.limits.max_message_bytes}-byte limit")
        return text

    async def handle(self, raw: dict[str, Any]) -> None:
        """One frame: checked, parsed by the dialect, answered after the audio before it."""
        try:
            message = self.parse(self.text_of(raw))
        except ProtocolError:
            await self.settle()
            raise
        audio = self.queues_audio(message)
        if not audio:
            await self.settle()
        try:
            await self.dispatch(message)
        except ProtocolError:
            if audio:  # its error goes out after the events of the audio before it
                await self.settle()
            raise

    async def next_message(self, timeout: float) -> dict[str, Any]:
        """The next client frame: kept ones first, then the socket (``TimeoutError``).

        Raises what halted the input feed (e.g. :class:`ClientNotReading` met
        while forwarding a frame's events) as soon as it happens.
        """
        if self.early:
            return self.early.popleft()
        receiving = self.receive()
        if self.feed is None:
            message = await asyncio.wait_for(asyncio.shield(receiving), timeout)
        else:
            if not self.feed.halted.done():
                await asyncio.wait({receiving, self.feed.halted}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            if self.feed.halted.done():
                raise self.feed.halted.result()
            if not self.receiving.done():
                raise asyncio.TimeoutError
            message = self.receiving.result()
        self.receiving = None
        return message


@dataclass(frozen=True)
class Dialect:
    """A wire dialect as the app serves it: its WebSocket paths (under ``--api-prefix``)
    and the :class:`Connection` subclass that speaks it."""

    name: str
    paths: tuple[str, ...]
    connection: type[Connection]
