"""One session's channel on the engine side: its inbox, where frames are cut, and its hand-off.

The inbox holds, in arrival order, PCM (:class:`Chunk`: the client's audio,
or the server's own silence) and markers (the engine commands that must see
the audio sent before them: commit, cancel, a tool result, a barrier). It is
the one place the server cuts native frames, so a client's chunk sizes never
change which samples make a frame. A marker runs once no whole frame can be
cut before it; the partial frame before it stays in the inbox (the samples
sent after the marker complete it), and a commit takes it explicitly
(:meth:`SessionChannel.take_partial`).

What the engine did for the session in one cycle -- a frame's runtime
events, a frame's error, the replies of the markers it ran, the client
samples that left the inbox -- is collected in one :class:`Handoff`, in
order, and handed to the session's sink on its event loop (its connection,
which translates the events into its dialect there).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import numpy as np


class Sink(Protocol):
    """Where a session's hand-offs go: ``on_handoff`` is called on ``event_loop``."""

    event_loop: Any

    def on_handoff(self, handoff: "Handoff") -> None: ...


@dataclass
class Chunk:
    """PCM of one append waiting to become frames."""

    samples: np.ndarray
    tag: object  # the append it came with: a frame's error drops the rest of it
    counted: bool = True  # the client's audio (its feed's room); False: the server's silence
    offset: int = 0

    @property
    def left(self) -> int:
        return self.samples.shape[0] - self.offset


@dataclass
class Reply:
    """A marker's answer, resolved on the loop in its place among the events."""

    command: Any
    value: Any = None
    error: BaseException | None = None

    def resolve(self) -> None:
        self.command.resolve(self.value, self.error)


@dataclass
class Handoff:
    """One cycle's output of a session, in order: a frame's events (a list), a frame's
    error (an exception) or a marker's :class:`Reply`; and the client samples consumed."""

    entries: list[Any] = field(default_factory=list)
    consumed: int = 0


def hand_off(sink: Sink | None, handoff: Handoff) -> None:
    """``sink.on_handoff(handoff)`` on the sink's loop (nothing once that loop has closed)."""
    if sink is None:
        return
    try:
        sink.event_loop.call_soon_threadsafe(sink.on_handoff, handoff)
    except RuntimeError:  # the loop has closed
        pass


class SessionChannel:
    """One open session's inbox (engine thread only)."""

    def __init__(self, frame_samples: int, sink: Sink | None = None):
        self.frame_samples = frame_samples
        self.sink = sink
        self.items: deque[Any] = deque()  # Chunk or a marker (an engine command)
        self.queued = 0  # samples in the chunks before the first marker
        self.ready_since: float | None = None  # when the head frame became complete
        self.last_arrival = float("-inf")
        self.out = Handoff()

    # --- filling ----------------------------------------------------------------

    def add_chunk(self, chunk: Chunk, now: float) -> None:
        self.last_arrival = now
        if not self.has_marker():
            self.queued += chunk.left
        self.items.append(chunk)
        self._mark(now)

    def add_marker(self, command: Any) -> None:
        self.items.append(command)

    def has_marker(self) -> bool:
        return any(not isinstance(item, Chunk) for item in self.items)

    @property
    def buffered(self) -> int:
        """Samples waiting in the inbox (all chunks, before and after markers)."""
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
        for item in self.items:
            if not isinstance(item, Chunk):
                return item
        return None

    def _mark(self, now: float) -> None:
        if not self.frame_ready():
            self.ready_since = None
        elif self.ready_since is None:
            self.ready_since = now

    # --- taking -------------------------------------------------------------------

    def take_frame(self, now: float) -> tuple[np.ndarray, object]:
        """The next native frame and the tag of the append that completed it."""
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
        self._requeue(now)
        return (np.concatenate(pieces) if len(pieces) > 1 else pieces[0]), tag

    def take_partial(self) -> np.ndarray:
        """The partial frame before the head marker, handed over (to a commit)."""
        pieces = []
        while self.items and isinstance(self.items[0], Chunk):
            chunk = self.items.popleft()
            pieces.append(chunk.samples[chunk.offset:])
            self._consumed(chunk, chunk.left)
        self.queued = 0
        return np.concatenate(pieces) if pieces else np.zeros((0,), np.float32)

    def pop_marker(self, now: float) -> Any:
        """Take the head marker out of the inbox; the partial frame before it stays."""
        marker = self.head_marker()
        self.items.remove(marker)
        self._requeue(now)
        return marker

    def drop_tag(self, tag: object, now: float) -> None:
        """Forget the rest of one append (its frame failed)."""
        kept: deque[Any] = deque()
        for item in self.items:
            if isinstance(item, Chunk) and item.tag is tag:
                self._consumed(item, item.left)
            else:
                kept.append(item)
        self.items = kept
        self._requeue(now)

    def drain(self) -> Iterator[Any]:
        """Every marker left (the session is closing); the PCM is forgotten."""
        while self.items:
            item = self.items.popleft()
            if isinstance(item, Chunk):
                self._consumed(item, item.left)
            else:
                yield item
        self.queued = 0
        self.ready_since = None

    def _consumed(self, chunk: Chunk, samples: int) -> None:
        if chunk.counted:
            self.out.consumed += samples

    def _requeue(self, now: float) -> None:
        queued = 0
        for item in self.items:
            if not isinstance(item, Chunk):
                break
            queued += item.left
        self.queued = queued
        self._mark(now)

    # --- out ----------------------------------------------------------------------

    def emit(self, entry: Any) -> None:
        """A frame's events (a list), a frame's error, or a marker's :class:`Reply`."""
        self.out.entries.append(entry)

    def send(self) -> None:
        """Hand this cycle's output to the sink (if there is any)."""
        out = self.out
        if out.entries or out.consumed:
            self.out = Handoff()
            hand_off(self.sink, out)
