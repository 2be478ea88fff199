"""A WebSocket's bounded outgoing queue and the task that writes it (on the event loop).

Events are queued, never awaited on the socket, so a client that stops
reading fills the queue instead of the server's memory: once
``max_pending`` new frames wait unsent, :meth:`Outbox.put` raises
:class:`ClientNotReading` and the connection is closed. A resume's replay
is promised, not new (:meth:`Outbox.promise`): its frames go first and are
written as the client reads them, counted apart (the replay log bounds them),
so only what the session makes after the resume counts as unread.
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
        self.max_pending = max_pending
        self.queue: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()  # (frame, promised)
        self.promised = 0  # promised frames not yet written
        self.failed: BaseException | None = None
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._write())

    def put(self, text: str) -> None:
        if self.failed is not None:
            raise ClientNotReading(f"the connection stopped sending: {type(self.failed).__name__}")
        if self.queue.qsize() - self.promised >= self.max_pending:
            raise ClientNotReading(f"{self.max_pending} events are waiting unread")
        self.queue.put_nowait((text, False))

    def promise(self, texts: list[str]) -> None:
        """Queue frames already promised to the client (a resume's replay): they never
        count as unread."""
        if self.failed is not None:
            raise ClientNotReading(f"the connection stopped sending: {type(self.failed).__name__}")
        for text in texts:
            self.promised += 1
            self.queue.put_nowait((text, True))

    async def _write(self) -> None:
        while True:
            text, promised = await self.queue.get()
            try:
                await self.ws.send_text(text)
            except Exception as exc:  # the client went away mid-send
                self.failed = exc
                return
            finally:
                self.promised -= promised
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
