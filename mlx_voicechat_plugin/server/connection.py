"""One client's realtime conversation: the message loop between a WebSocket and the engine.

A connection runs: accept, ``session.created``, then messages until
commit/cancel (close 1000), a timeout (close 1008), a client that stops
reading its events (close 1008, ``client is not reading``) or the client
leaving. Events go out through a bounded :class:`~.outbox.Outbox`. Audio
payloads are never logged; client values are never used as paths
(``session.model`` is ignored).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from . import protocol
from .engine import Engine
from .feed import InputFeed
from .limits import ServerLimits
from .outbox import NOT_READING, ClientNotReading, Outbox
from .protocol import CloseCode, ErrorCode, ProtocolError

logger = logging.getLogger(__name__)

INPUT_RATE, OUTPUT_RATE = 16_000, 22_050  # announced before the model is known


class Connection:
    """One client's conversation with the engine."""

    def __init__(self, websocket: WebSocket, engine: Engine, model_id: str,
                 limits: ServerLimits):
        self.ws = websocket
        self.engine = engine
        self.model_id = model_id
        self.limits = limits
        self.session_id = protocol.new_session_id()
        self.configured = False
        self.tools_set = False
        self.open = False  # the engine holds our streaming session
        self.closing: asyncio.Future | None = None  # the engine's close, once queued
        self.frame_samples = 0
        self.connected_at = time.monotonic()
        self.last_activity = self.connected_at  # last audio or successful request
        self.failed_updates = 0
        self.receiving: asyncio.Future | None = None  # a pending ws.receive()
        self.early: deque[dict[str, Any]] = deque()  # frames read while a prefill ran
        self.outbox = Outbox(websocket, limits.max_pending_events)
        self.subprotocol: str | None = None  # selected at accept (a browser's "realtime")
        self.feed: InputFeed | None = None  # the session's input queue, from the first audio

    async def send(self, payload: dict[str, Any]) -> None:
        self.outbox.put(protocol.dumps(payload))

    async def send_error(self, code: str, message: str) -> None:
        logger.info("%s error %s: %s", self.session_id, code, message)
        await self.send(self.error_payload(code, message))

    # --- what a dialect says differently (see connection_ga.GAConnection) ----

    def error_payload(self, code: str, message: str) -> dict[str, Any]:
        return protocol.error_event(code, message)

    def greeting(self) -> dict[str, Any]:
        """``session.created``, sent once the connection is admitted."""
        return protocol.session_created(self.session_id, INPUT_RATE, OUTPUT_RATE)

    def let_go(self) -> None:
        """Queue the engine's close (cancelling unflushed audio) and free the slot, now.

        The close is queued before the slot is freed, and the engine runs its
        commands in order, so a client reconnecting at once is admitted and
        its session opens after this one is gone. Safe to call again.
        """
        if self.open:
            self.open = False
            self.closing = self.engine.submit("close", self.session_id)
        self.engine.release(self.session_id)

    async def release(self) -> None:
        """:meth:`let_go`, then wait for the engine to have closed the session."""
        self.let_go()
        closing, self.closing = self.closing, None
        if closing is not None:
            try:
                await closing
            except Exception:
                logger.exception("closing %s failed", self.session_id)

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

    async def run(self) -> None:
        await self.ws.accept(subprotocol=self.subprotocol)
        self.outbox.start()
        try:
            if not self.engine.ready:
                await self.send_error(ErrorCode.SERVER_BUSY, "the model is not loaded")
                await self.finish(CloseCode.TRY_AGAIN_LATER)
                return
            if not self.engine.try_reserve(self.session_id):
                await self.send_error(ErrorCode.SERVER_BUSY, self.engine.refusal)
                await self.finish(CloseCode.TRY_AGAIN_LATER)
                return
            logger.info("%s connected", self.session_id)
            await self.send(self.greeting())
            await self.loop()
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
        while True:
            deadline, reason = self.deadline()
            try:
                message = await self.next_message(max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                await self.send_error(ErrorCode.INVALID_REQUEST, reason)
                await self.finish(CloseCode.POLICY_VIOLATION)
                return
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            try:
                done = await self.handle(message)
            except ProtocolError as exc:
                await self.send_error(exc.code, exc.message)
                done = False
                if exc.code == ErrorCode.SESSION_INITIALIZATION_FAILED:
                    self.failed_updates += 1
                    if self.failed_updates >= self.limits.max_failed_updates:
                        await self.send_error(ErrorCode.INVALID_REQUEST,
                                              f"{self.failed_updates} failed session.update "
                                              "messages; closing")
                        await self.finish(CloseCode.POLICY_VIOLATION)
                        return
            if done:
                return

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

    async def handle(self, raw: dict[str, Any]) -> bool:
        """Handle one frame; ``True`` once the connection is finished."""
        try:
            message = protocol.parse_message(self.text_of(raw))
        except ProtocolError:
            await self.settle()
            raise
        if not isinstance(message, protocol.AudioAppend):
            await self.settle()
        if isinstance(message, protocol.Ping):
            await self.send({"type": "session.pong"})
            return False
        if isinstance(message, protocol.SessionUpdate):
            await self.configure(message)
            self.active()
            return False
        if not self.configured:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "send session.update before audio")
        if isinstance(message, protocol.ToolOutput):
            await self.tool_output(message)
            self.active()
            return False
        if isinstance(message, protocol.AudioAppend):
            await self.append(message)  # marks the session active when it carries audio
            return False
        if isinstance(message, protocol.Commit):
            # As the reference orders them: the audio of frames appended
            # before the commit, ``committed``, then the flushed frames.
            earlier, events = await self.engine_call(
                self.engine.flush(self.session_id, message.pad_partial))
            await self.forward(earlier)
            await self.send({"type": "input_audio_buffer.committed"})
        else:
            events = await self.engine_call(self.engine.cancel(self.session_id))
        await self.forward(events)
        await self.finish(CloseCode.NORMAL)
        return True

    async def configure(self, update: protocol.SessionUpdate) -> None:
        if self.configured:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                "the active session cannot be reconfigured")
        seconds = self.limits.clamp_streaming_seconds(update.max_streaming_seconds)
        if update.text_only:  # perception + RNNT only: the user transcript
            opening = self.engine.submit(
                "open", self.session_id, text_only=True, max_streaming_seconds=seconds,
                max_transcript_bytes=self.limits.max_transcript_bytes)
        else:
            opening = self.engine.submit_open(
                self.session_id, system_prompt=update.system_prompt, seed=update.seed,
                max_streaming_seconds=seconds, tools=update.tools,
                max_prompt_tokens=self.limits.max_prompt_tokens)
        self.open = True  # the engine may hold a stream from now on: release closes it
        await self.watch(opening)
        try:
            details = opening.result()
        except Exception as exc:
            raise ProtocolError(ErrorCode.SESSION_INITIALIZATION_FAILED, str(exc)) from None
        self.configured = True
        self.tools_set = update.tools is not None
        self.frame_samples = details["frame_samples"]
        logger.info("%s configured (seed %d, max %.1f s)", self.session_id, update.seed, seconds)
        await self.send(protocol.session_updated(self.session_id, self.model_id, details))

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

    async def tool_output(self, message: protocol.ToolOutput) -> None:
        """A tool result: its tokens enter the timeline at the next frames."""
        if not self.tools_set:
            raise ProtocolError(ErrorCode.TOOLS_NOT_SET,
                                "function_call_output needs tools registered in session.update")
        try:
            await self.engine.tool_result(self.session_id, message.call_id, message.output)
        except ValueError as exc:  # unknown / answered call_id, non-ASCII output
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        except Exception as exc:
            raise ProtocolError(ErrorCode.INFERENCE_ERROR, str(exc) or type(exc).__name__) from None

    async def settle(self) -> None:
        """Wait until the audio queued so far has run and its events went out: what
        the client sends besides audio is answered in order, after them."""
        if self.feed is not None:
            await self.engine_call(self.engine.sync(self.session_id))

    async def append(self, message: protocol.AudioAppend) -> None:
        try:
            samples = protocol.decode_pcm16(message.audio)
            rate = protocol.check_sample_rate(message.sample_rate)
        except ProtocolError:
            await self.settle()
            raise
        if samples.shape[0]:
            self.active()
        # Queued, not awaited: the frames run in batched steps with the other
        # sessions' and their events come back in order (deliver / frame_error).
        await self.input_feed().append(samples, rate)

    def input_feed(self) -> InputFeed:
        """The session's bounded input queue (``--max-buffered-seconds``)."""
        if self.feed is None:
            self.feed = InputFeed(self.engine, self.session_id,
                                  self.limits.buffered_samples(INPUT_RATE, self.frame_samples),
                                  self.deliver, self.frame_error)
        return self.feed

    def deliver(self, events: list[str]) -> None:
        """A frame's events, from the engine (on the loop): into the outbox, in order."""
        try:
            for text in events:
                self.outbox.put(text)
        except ClientNotReading as exc:
            self.input_feed().halt(exc)

    def frame_error(self, exc: BaseException) -> None:
        """A queued frame failed: ``inference_error`` (the rest of its append is dropped)."""
        message = str(exc) or type(exc).__name__
        logger.info("%s error %s: %s", self.session_id, ErrorCode.INFERENCE_ERROR, message)
        self.deliver([protocol.dumps(self.error_payload(ErrorCode.INFERENCE_ERROR, message))])

    async def engine_call(self, call: Any) -> list[str]:
        """Await an engine command; its failure is the client's ``inference_error``."""
        try:
            return await call
        except Exception as exc:
            raise ProtocolError(ErrorCode.INFERENCE_ERROR, str(exc) or type(exc).__name__) from None

    async def forward(self, events: list[str]) -> None:
        for text in events:
            self.outbox.put(text)
