"""A session's side of its channel, on the event loop: bounded, answered asynchronously.

:meth:`InputFeed.append` hands PCM to the engine and returns without
waiting for the frames to run, so a client's frames queue up and join the
batched pool steps as they form. At most ``max_samples`` wait in the engine
for one session (``--max-buffered-seconds``); beyond that ``append`` waits
for room, the connection stops reading its socket meanwhile (past the one
message it reads ahead, to see a client that leaves), and TCP holds the
client back: a flooding client costs its bound, never more memory.

The engine reports the samples that left the channel in the session's
hand-offs (:meth:`consumed`, called by the session on its loop).
:attr:`halted` resolves (with an exception for the connection to raise) once
the connection must stop, e.g. its client stopped reading.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np


class InputFeed:
    """One session's bounded PCM hand-over to the engine (event-loop side)."""

    def __init__(self, engine: Any, session_id: str, max_samples: int, sink: Any):
        self.engine = engine
        self.session_id = session_id
        self.max_samples = max_samples  # at least a frame (ServerLimits.buffered_samples)
        self.sink = sink  # told if the session is not open
        self.buffered = 0  # samples handed over and not yet taken into a frame
        self.halted: asyncio.Future = asyncio.get_running_loop().create_future()
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
            self.engine.append(self.session_id, piece, self.sink, tag)
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

    def consumed(self, samples: int) -> None:
        """``samples`` left the channel (on the loop): room for more."""
        self.buffered -= samples
        if self.buffered < self.max_samples:
            self._room.set()
