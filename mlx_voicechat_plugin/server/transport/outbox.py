"""A WebSocket's bounded outgoing queue and the task that writes it (on the event loop).

Events are queued, never awaited on the socket, so a client that stops
reading fills the queue instead of the server's memory: once
``max_pending`` new frames, or ``max_pending_bytes`` of them (UTF-8, counted
until the socket has taken each), wait unsent, :meth:`Outbox.put` raises
:class:`ClientNotReading` and the connection is closed. A resume's replay
is promised, not new (:meth:`Outbox.promise`): its frames go first and are
written as the client reads them, counted apart (the replay log bounds them),
so only what the session makes after the resume counts as unread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..messages import NOT_READING, ClientNotReading

__all__ = ["NOT_READING", "ClientNotReading", "Outbox", "frame_bytes"]


def frame_bytes(text: str) -> int:
    """The UTF-8 size of a text frame (its length when it is ASCII, as most are)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


class Outbox:
    """Frames for one WebSocket, written in order by one background task."""

    def __init__(self, websocket: Any, max_pending: int, max_pending_bytes: int):
        self.ws = websocket
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        # (frame, its bytes, promised); a promised frame's bytes are 0: never counted
        self.queue: asyncio.Queue[tuple[str, int, bool]] = asyncio.Queue()
        self.promised = 0  # promised frames not yet written
        self.pending_bytes = 0  # new frames' bytes queued or being written
        self.failed: BaseException | None = None
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._write())

    def put(self, text: str) -> None:
        if self.failed is not None:
            raise ClientNotReading(f"the connection stopped sending: {type(self.failed).__name__}")
        if self.queue.qsize() - self.promised >= self.max_pending:
            raise ClientNotReading(f"{self.max_pending} events are waiting unread")
        if self.pending_bytes >= self.max_pending_bytes:
            raise ClientNotReading(f"{self.pending_bytes} bytes of events are waiting unread")
        size = frame_bytes(text)
        self.pending_bytes += size
        self.queue.put_nowait((text, size, False))

    def promise(self, texts: list[str]) -> None:
        """Queue frames already promised to the client (a resume's replay): they never
        count as unread."""
        if self.failed is not None:
            raise ClientNotReading(f"the connection stopped sending: {type(self.failed).__name__}")
        for text in texts:
            self.promised += 1
            self.queue.put_nowait((text, 0, True))

    async def _write(self) -> None:
        while True:
            text, size, promised = await self.queue.get()
            try:
                await self.ws.send_text(text)
            except Exception as exc:  # the client went away mid-send
                self.failed = exc
                return
            finally:
                self.promised -= promised
                self.pending_bytes -= size
                self.queue.task_done()

    async def drain(self, timeout: float) -> bool:
        """Wait until every queued frame is written; ``False`` if it took too long."""
        if self.task is None or self.failed is not None:
            return self.failed is None
        try:
            await asyncio.wait_for(self.queue.join(), timeout)
        except asyncio.TimeoutError:
            return False
        return self.failed is None

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
