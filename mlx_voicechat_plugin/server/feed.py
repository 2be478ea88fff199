"""A connection's side of its session's input queue: bounded, answered asynchronously.

:meth:`InputFeed.append` hands PCM to the engine and returns without
waiting for the frames to run, so a client's frames queue up and join the
batched pool steps as they form. At most ``max_samples`` wait in the engine
for one session (``--max-buffered-seconds``); beyond that ``append`` waits
for room, the connection stops reading its socket meanwhile, and TCP holds
the client back: a flooding client costs its bound, never more memory.

The engine answers on the event loop (``loop.call_soon_threadsafe``), in the
order it ran the session's frames: :meth:`events` with each frame's event
texts, :meth:`failed` with a frame's error, :meth:`consumed` as samples leave
the queue. :attr:`halted` resolves (with an exception for the connection to
raise) once the connection must stop, e.g. its client stopped reading.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable

import numpy as np

Deliver = Callable[[list], None]  # event texts -> the connection's outbox
Fail = Callable[[BaseException], None]  # a frame's error -> the connection


class InputFeed:
    """One session's bounded PCM hand-over to the engine (event-loop side)."""

    def __init__(self, engine: Any, session_id: str, max_samples: int, deliver: Deliver,
                 fail: Fail):
        if max_samples <= 0:
            raise ValueError(f"max_samples must be positive, got {max_samples!r}")
        self.engine = engine
        self.session_id = session_id
        self.max_samples = max_samples
        self.deliver = deliver
        self.fail = fail
        self.loop = asyncio.get_running_loop()
        self.buffered = 0  # samples handed over and not yet taken into a frame
        self.peak = 0  # the most ever buffered
        self.halted: asyncio.Future = self.loop.create_future()
        self._room = asyncio.Event()
        self._room.set()
        self._tags = itertools.count()

    async def append(self, samples: np.ndarray) -> None:
        """Queue one append's PCM (at the session's input rate); waits (not reading the
        socket) while the buffer is full."""
        tag = ("append", next(self._tags))  # a failing frame drops the rest of this append
        start = 0
        while start < samples.shape[0]:
            room = self.max_samples - self.buffered
            if room <= 0:
                self._room.clear()
                await self._wait_for_room()
                continue
            piece = samples[start : start + room]
            self.buffered += piece.shape[0]
            self.peak = max(self.peak, self.buffered)
            self.engine.append(self.session_id, piece, self, tag)
            start += piece.shape[0]

    async def _wait_for_room(self) -> None:
        room = asyncio.ensure_future(self._room.wait())
        try:
            await asyncio.wait({room, self.halted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            room.cancel()
        if self.halted.done():
            raise self.halted.result()

    def halt(self, exc: BaseException) -> None:
        """Stop the connection at its next wait with ``exc`` (first call wins)."""
        if not self.halted.done():
            self.halted.set_result(exc)

    # --- called on the loop by the engine ----------------------------------------

    def consumed(self, samples: int) -> None:
        self.buffered -= samples
        if self.buffered < self.max_samples:
            self._room.set()

    def events(self, texts: list[str]) -> None:
        if texts:
            self.deliver(texts)

    def failed(self, exc: BaseException) -> None:
        self.fail(exc)
