"""The WebSocket transport: frames in, typed messages out as JSON text, closes with its codes.

A :class:`WebSocketTransport` runs on the event loop. It accepts the upgrade
(with the subprotocol the app selected), hands each client frame over as
``str`` (a text frame) or ``bytes`` (a binary frame), or a
:class:`~..messages.Hangup` once the client has gone, and sends the
session's typed messages (:mod:`..messages`) in order through a bounded
:class:`~.outbox.Outbox`: each serialized here (:func:`serialize`: stamped
with an ``event_id``, compact JSON, a message's audio as base64 in its
event's field), at most ``max_pending`` events or ``max_pending_bytes`` unsent; it
reads the client's frames no faster than its :class:`ReadRate`. It closes for an
:class:`~..messages.Ending` with the close
code that says it (:data:`CLOSE_CODES`). It knows no dialect: what a frame
means, and what is sent, is the dialect's business.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any, Union

from ..messages import PLAYBACK, AudioOut, Ending, Hangup, JsonText, Outgoing
from ..wire import CloseCode, dumps
from .outbox import Outbox

logger = logging.getLogger(__name__)

Received = Union[str, bytes, Hangup]
# Seconds the close frame may wait for the socket to take it (a client that reads
# nothing never does; the socket is then aborted below, transport.guard).
CLOSE_TIMEOUT_SECONDS = 2.0

CLOSE_CODES = {
    Ending.DONE: CloseCode.NORMAL,
    Ending.BUSY: CloseCode.TRY_AGAIN_LATER,
    Ending.VIOLATION: CloseCode.POLICY_VIOLATION,
    Ending.NOT_READING: CloseCode.POLICY_VIOLATION,
    Ending.STOPPING: CloseCode.GOING_AWAY,
    Ending.SUPERSEDED: CloseCode.NORMAL,  # this client's conversation goes on elsewhere
}


def serialize(message: Outgoing) -> str:
    """A message as the text frame sent; audio goes into its event as base64."""
    if isinstance(message, AudioOut):
        payload = dict(message.event)
        payload[message.field] = base64.b64encode(message.data).decode("ascii")
        return dumps(payload)
    if isinstance(message, JsonText):
        return message.text
    return dumps(message.payload)


class ReadRate:
    """A connection's read budget: ``per_second`` bytes a second past a ``burst``.

    A frame past the budget is handed over once the budget has refilled, so a client
    sending faster waits on its own socket (the ASGI server reads no further frame
    until this one is taken) and costs the server what the rate allows, not what its
    connection can carry; nothing is refused.
    """

    def __init__(self, per_second: int, burst: int):
        self.per_second = per_second
        self.burst = burst
        self.tokens = float(burst)
        self.checked = time.monotonic()

    def wait_for(self, size: int) -> float:
        """Seconds to wait before a frame of ``size`` bytes is taken (charged now)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.checked) * self.per_second)
        self.checked = now
        self.tokens -= size
        return max(0.0, -self.tokens / self.per_second)


class WebSocketTransport:
    """One client's WebSocket (Starlette's), as the connection sees it."""

    plays_audio = False  # the client plays (and drops) the audio it is sent
    joins_audio = False  # one receive, one frame: the connection may read ahead

    def __init__(self, websocket: Any, max_pending: int, send_timeout: float,
                 subprotocol: str | None = None, *, max_pending_bytes: int,
                 read_rate: ReadRate | None = None):
        self.ws = websocket
        self.subprotocol = subprotocol  # selected at accept (a browser's "realtime")
        self.send_timeout = send_timeout
        self.outbox = Outbox(websocket, max_pending, max_pending_bytes)
        self.read_rate = read_rate

    async def accept(self) -> None:
        await self.ws.accept(subprotocol=self.subprotocol)
        self.outbox.start()

    async def receive(self) -> Received:
        """The next client frame (``str`` or ``bytes``), or :class:`Hangup` once it left."""
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            return Hangup(message.get("code", 1000))
        text = message.get("text")
        frame = text if text is not None else message.get("bytes") or b""
        if self.read_rate is not None:
            wait = self.read_rate.wait_for(len(frame))
            if wait:
                await asyncio.sleep(wait)
        return frame

    def send(self, message: Outgoing) -> None:
        """Queue ``message`` (:class:`~..messages.ClientNotReading` when the client does
        not read); :class:`ClearAudio` and :class:`AudioMark` are not for it."""
        if not isinstance(message, PLAYBACK):
            self.outbox.put(serialize(message))

    def promise(self, messages: list[Outgoing]) -> None:
        """Queue a resume's replay: sent as the client reads, never counted as unread."""
        self.outbox.promise([serialize(m) for m in messages if not isinstance(m, PLAYBACK)])

    async def drain(self) -> bool:
        """Let the queued messages go out; ``False`` if they took past the send timeout."""
        return await self.outbox.drain(self.send_timeout)

    async def stop(self) -> None:
        """Stop sending (what is still queued is dropped)."""
        await self.outbox.stop()

    async def close(self, ending: Ending, reason: str = "") -> None:
        """Best effort, bounded: a client that reads nothing never takes the close frame."""
        code = CLOSE_CODES[ending]
        try:
            await asyncio.wait_for(self.ws.close(code=code, reason=reason),
                                   min(self.send_timeout, CLOSE_TIMEOUT_SECONDS))
        except (asyncio.TimeoutError, Exception) as exc:
            logger.info("close %d not delivered (%s)", code, type(exc).__name__)
