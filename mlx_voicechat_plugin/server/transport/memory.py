"""An in-memory transport: a dialect and a session driven with no socket (tests, tools).

:class:`MemoryTransport` has the WebSocket transport's shape (accept, frames
in, typed messages out, a close for an :class:`~..messages.Ending`) and
keeps both sides in this process, on the event loop: the client end puts
frames (:meth:`~MemoryTransport.put`) or hangs up
(:meth:`~MemoryTransport.hang_up`), and reads what was sent, typed
(:attr:`~MemoryTransport.sent`) or as a WebSocket client would see it
(:meth:`~MemoryTransport.events`). Like the WebSocket's outbox, at most
``max_pending`` messages, or ``max_pending_bytes`` of them as serialized, wait
unread (a resume's replay apart) before the client counts as not reading.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ..limits import DEFAULT_MAX_PENDING_BYTES
from ..messages import PLAYBACK, ClientNotReading, Ending, Hangup, Outgoing
from .outbox import frame_bytes
from .websocket import Received, serialize


class MemoryTransport:
    """Both ends of one in-process transport (one event loop)."""

    plays_audio = False  # like a WebSocket's client, the test plays what it reads
    joins_audio = False  # one receive, one message

    def __init__(self, max_pending: int = 256,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES):
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.inbox: asyncio.Queue[Received] = asyncio.Queue()
        self.sent: list[Outgoing] = []  # every message sent, in order
        self.read = 0  # messages the client has taken (:meth:`take`)
        self.promised_until = 0  # sent[:promised_until] was a replay: never unread
        self.ends = [0]  # ends[i]: serialized bytes of sent[:i] (a replay's counted as 0)
        self.arrived = asyncio.Event()  # set whenever a message is sent
        self.accepted = False
        self.closed: tuple[Ending, str] | None = None  # the ending and its reason, once closed

    # --- the server's side ---------------------------------------------------------

    async def accept(self) -> None:
        self.accepted = True

    async def receive(self) -> Received:
        return await self.inbox.get()

    def send(self, message: Outgoing) -> None:
        if isinstance(message, PLAYBACK):
            return  # about a track's playback: not for this transport
        if self.closed is not None:
            raise ClientNotReading("the transport is closed")
        unread = max(self.read, self.promised_until)
        if len(self.sent) - unread >= self.max_pending:
            raise ClientNotReading(f"{self.max_pending} events are waiting unread")
        if self.ends[-1] - self.ends[unread] >= self.max_pending_bytes:
            raise ClientNotReading(f"{self.ends[-1] - self.ends[unread]} bytes of events "
                                   "are waiting unread")
        self.sent.append(message)
        self.ends.append(self.ends[-1] + frame_bytes(serialize(message)))
        self.arrived.set()

    def promise(self, messages: list[Outgoing]) -> None:
        """A resume's replay: queued whatever is unread (it never counts as unread)."""
        self.sent.extend(m for m in messages if not isinstance(m, PLAYBACK))
        self.ends.extend([self.ends[-1]] * (len(self.sent) - len(self.ends) + 1))
        self.promised_until = len(self.sent)
        self.arrived.set()

    async def drain(self) -> bool:
        return True

    async def stop(self) -> None:
        pass

    async def close(self, ending: Ending, reason: str = "") -> None:
        if self.closed is None:
            self.closed = (ending, reason)
        self.arrived.set()

    # --- the client's side ---------------------------------------------------------

    def put(self, frame: str | bytes | dict[str, Any]) -> None:
        """A client frame: text, binary, or a dict sent as JSON text."""
        self.inbox.put_nowait(json.dumps(frame) if isinstance(frame, dict) else frame)

    def hang_up(self, code: int = 1000) -> None:
        """The client leaves."""
        self.inbox.put_nowait(Hangup(code))

    def events(self, start: int = 0) -> list[dict[str, Any]]:
        """What was sent from ``start`` on, as a WebSocket client reads it (JSON objects)."""
        return [json.loads(serialize(m)) for m in self.sent[start:]]

    async def take(self, timeout: float = 10.0) -> dict[str, Any]:
        """The next message the client has not read, as a JSON object (waits for it)."""
        while self.read >= len(self.sent):
            if self.closed is not None:
                raise EOFError(f"closed: {self.closed}")
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), timeout)
        self.read += 1
        return json.loads(serialize(self.sent[self.read - 1]))
