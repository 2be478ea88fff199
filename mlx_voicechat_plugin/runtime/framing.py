"""The one framer: PCM pieces of any size in, native frames out, the partial frame kept.

A stream is cut into frames of ``frame_samples`` in one place, so a caller's
chunk sizes never change which samples make a frame. :class:`Framer` holds,
in arrival order, PCM (:class:`Chunk`) and, for a caller that needs them,
markers: any other object that must see the audio queued before it (the
server's commit, cancel, tool result, barrier). Frames are cut only from the
PCM before the first marker; a marker is due once no whole frame can be cut
before it, and the partial frame before it stays (the samples after the
marker complete it) unless :meth:`Framer.take_partial` takes it.

A stream has exactly one: a :class:`~.streaming.StreamingShell` of its own
frames what ``push_audio`` is given with its framer; a pool's stream has none,
and the server's session channel (:mod:`..server.engine.channel`) frames the
client's appends with the one it holds and hands the stream whole frames. A
framer is driven from one thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import takewhile
from typing import Any, Callable, Iterator

import numpy as np


@dataclass
class Chunk:
    """PCM of one append waiting to become frames."""

    samples: np.ndarray
    tag: object = None  # the append it came with: a frame's error drops the rest of it
    counted: bool = True  # the client's audio (its feed's room); False: the server's silence
    offset: int = 0

    @property
    def left(self) -> int:
        return self.samples.shape[0] - self.offset


class Framer:
    """PCM and markers in arrival order, cut into frames of ``frame_samples``.

    ``on_consumed(n)`` is told of every ``n`` counted samples that leave (in a
    frame, a partial frame, or dropped).
    """

    def __init__(self, frame_samples: int, on_consumed: Callable[[int], None] | None = None):
        self.frame_samples = frame_samples
        self.on_consumed = on_consumed
        self.items: deque[Any] = deque()  # Chunk or a marker

    # --- filling ----------------------------------------------------------------

    def add_chunk(self, chunk: Chunk) -> None:
        self.items.append(chunk)

    def add_marker(self, marker: Any) -> None:
        self.items.append(marker)

    @property
    def queued(self) -> int:
        """Samples in the chunks before the first marker."""
        return sum(item.left for item in takewhile(lambda i: isinstance(i, Chunk), self.items))

    @property
    def buffered(self) -> int:
        """Samples waiting (all chunks, before and after markers)."""
        return sum(item.left for item in self.items if isinstance(item, Chunk))

    @property
    def nbytes(self) -> int:
        return sum(item.samples[item.offset:].nbytes for item in self.items
                   if isinstance(item, Chunk))

    # --- what is ready ------------------------------------------------------------

    def frame_ready(self) -> bool:
        return self.queued >= self.frame_samples

    def head_marker(self) -> Any:
        """The first marker once no frame can be cut before it, else ``None``."""
        if self.frame_ready():
            return None
        return next((item for item in self.items if not isinstance(item, Chunk)), None)

    # --- taking -------------------------------------------------------------------

    def take_frame(self) -> tuple[np.ndarray, object]:
        """The next frame and the tag of the chunk that completed it."""
        want, pieces, tag = self.frame_samples, [], None
        while want:
            chunk = self.items[0]
            piece = chunk.samples[chunk.offset : chunk.offset + want]
            chunk.offset += piece.shape[0]
            want -= piece.shape[0]
            pieces.append(piece)
            self._consumed(chunk, piece.shape[0])
            tag = chunk.tag
            if not chunk.left:
                self.items.popleft()
        return (np.concatenate(pieces) if len(pieces) > 1 else pieces[0]), tag

    def take_frames(self) -> list[np.ndarray]:
        """Every frame that can be cut now, in order."""
        frames = []
        while self.frame_ready():
            frames.append(self.take_frame()[0])
        return frames

    def take_partial(self) -> np.ndarray:
        """The partial frame before the head marker (or the end), handed over."""
        pieces = []
        while self.items and isinstance(self.items[0], Chunk):
            chunk = self.items.popleft()
            pieces.append(chunk.samples[chunk.offset:])
            self._consumed(chunk, chunk.left)
        if not pieces:
            return np.zeros((0,), np.float32)
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def pop_marker(self) -> Any:
        """Take the head marker out; the partial frame before it stays."""
        marker = self.head_marker()
        self.items.remove(marker)
        return marker

    def drop_tag(self, tag: object) -> None:
        """Forget the rest of one append (its frame failed)."""
        kept: deque[Any] = deque()
        for item in self.items:
            if isinstance(item, Chunk) and item.tag is tag:
                self._consumed(item, item.left)
            else:
                kept.append(item)
        self.items = kept

    def drain(self) -> Iterator[Any]:
        """Every marker left; the PCM is forgotten."""
        while self.items:
            item = self.items.popleft()
            if isinstance(item, Chunk):
                self._consumed(item, item.left)
            else:
                yield item

    def clear(self) -> None:
        """Forget everything queued."""
        for _ in self.drain():
            pass

    def _consumed(self, chunk: Chunk, samples: int) -> None:
        if chunk.counted and self.on_consumed is not None:
            self.on_consumed(samples)
