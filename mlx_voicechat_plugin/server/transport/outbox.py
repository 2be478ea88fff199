"""A WebSocket's bounded outgoing queue and the task that writes it (on the event loop).

Events are queued, never awaited on the socket, so a client that stops
reading fills the queue instead of the server's memory: once
``max_pending`` frames wait unsent, :meth:`Outbox.put` raises
:class:`ClientNotReading` and the connection is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..messages import NOT_READING, ClientNotReading

__all__ = ["NOT_READING", "ClientNotReading", "Outbox"]


class Outbox:
    """Frames for one WebSocket, written in order by one background task."""

    def __init__(self, websocket: Any, max_pending: int):
        self.ws = websocket
        self.queue: asyncio.Queue[str] = asyncio.Queue(maxsize=max_pending)
        self.failed: BaseException | None = None
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._write())

    def put(self, text: str) -> None:
        if self.failed is not None:
            raise ClientNotReading(f"the connection stopped sending: {type(self.failed).__name__}")
        try:
            self.queue.put_nowait(text)
        except asyncio.QueueFull:
            raise ClientNotReading(
                f"{self.queue.maxsize} events are waiting unread") from None

    async def _write(self) -> None:
        while True:
            text = await self.queue.get()
            try:
                await self.ws.send_text(text)
            except Exception as exc:  # the client went away mid-send
                self.failed = exc
                return
            finally:
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
