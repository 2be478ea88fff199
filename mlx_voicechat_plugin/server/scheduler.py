"""Per-session input queues and the rule that turns them into batched pool steps (engine thread).

A connection hands PCM to its session's queue without waiting for each
frame's events (:class:`~.feed.InputFeed`); session commands that must see
the audio sent before them (commit, cancel, a tool result, a barrier) wait
in the same queue, behind it. The engine cuts the queued PCM into native
frames itself, so a client's chunk sizes never change which samples make a
frame.

:class:`BatchScheduler` decides when to step: at once when every session
that is streaming has a frame ready, else when the ready frames have waited
``batch_wait`` seconds since the engine was free to run them. A session
counts as streaming while it received PCM within the last ``EXPECT_FRAMES``
frames (a partial frame left behind does not count), so a client that stops
sending holds the others up for at most one collection deadline, then not at
all.

Filling (``fill``, on by default): once the streaming sessions' frames run one
by one would take more than ``FILL_LOAD`` of a frame (each session's cost
is the measured step time of the smallest batch, :class:`StepCosts`), the
engine has no time to spare for small steps, and the deadline becomes
``1 - FILL_MARGIN`` of a frame after the oldest ready frame became ready:
clients whose frames arrive spread over the frame period then fall into one
step instead of two or three (a step per frame period, each frame waiting
less than one period; a frame's audio is due one period after the next
frame's input). Below that load the short ``batch_wait`` keeps the latency a
lightly loaded server adds low. Once steps run back to back, the frames
have waited that long when the step before them ends, so filling never
idles a saturated engine.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

# A session that sent nothing for this many frames is not waited for.
EXPECT_FRAMES = 2
# Batches fill once the streaming sessions' frames run alone would take this share of a frame.
FILL_LOAD = 0.75
# A filled step is due this share of a frame before the oldest frame's period ends.
FILL_MARGIN = 0.125
# Weight of the newest step in the step-time averages.
STEP_SMOOTHING = 0.2


@dataclass
class Chunk:
    """PCM of one append (or one :meth:`Engine.push`) waiting to become frames."""

    samples: np.ndarray
    tag: object  # the append it came with: a frame's error drops the rest of it
    feed: Any = None  # where the events of the frames it completes go (an InputFeed)
    reply: Any = None  # or: the push command answered with them once it has run
    offset: int = 0
    events: list[str] = field(default_factory=list)  # a push's, until it is answered

    @property
    def left(self) -> int:
        return self.samples.shape[0] - self.offset


@dataclass
class Frame:
    """One native frame taken from a session's queue."""

    samples: np.ndarray
    owner: Chunk  # the chunk that completed it: its events and errors go there
    consumed: list[tuple[Any, int]]  # (feed, samples) that left the queue
    finished: list[Chunk]  # chunks all of whose samples have now left the queue


class SessionInput:
    """One session's queue: PCM chunks and the commands behind them, in arrival order."""

    def __init__(self, frame_samples: int, rate: int):
        self.frame_samples = frame_samples
        self.rate = rate
        self.items: deque[Any] = deque()  # Chunk or an engine command
        self.staged = 0  # samples handed to the stream ahead of a command, not yet a frame
        self.queued = 0  # samples in the chunks before the first command
        self.ready_since: float | None = None  # when the head frame became complete
        self.last_arrival = float("-inf")

    # --- filling ----------------------------------------------------------------

    def add_chunk(self, chunk: Chunk, now: float) -> None:
        self.last_arrival = now
        if not self.has_command():
            self.queued += chunk.left
        self.items.append(chunk)
        self._mark(now)

    def add_command(self, command: Any) -> None:
        self.items.append(command)

    def has_command(self) -> bool:
        return any(not isinstance(item, Chunk) for item in self.items)

    @property
    def buffered(self) -> int:
        """Samples waiting in the queue (all chunks, before and after commands)."""
        return sum(item.left for item in self.items if isinstance(item, Chunk))

    @property
    def nbytes(self) -> int:
        return sum(item.samples[item.offset:].nbytes for item in self.items
                   if isinstance(item, Chunk))

    # --- what is ready ------------------------------------------------------------

    def frame_ready(self) -> bool:
        return self.staged + self.queued >= self.frame_samples

    def expected(self, now: float, frame_seconds: float) -> bool:
        """Whether a frame of this session is due soon (it is streaming)."""
        return now - self.last_arrival <= EXPECT_FRAMES * frame_seconds

    def head_command(self) -> Any:
        """The command at the head once no frame can be cut before it, else ``None``."""
        if self.frame_ready():
            return None
        for item in self.items:
            if not isinstance(item, Chunk):
                return item
        return None

    def _mark(self, now: float) -> None:
        if self.frame_ready():
            if self.ready_since is None:
                self.ready_since = now
        else:
            self.ready_since = None

    # --- taking -------------------------------------------------------------------

    def take_frame(self, now: float) -> Frame:
        """The next frame's samples (less what the stream already holds)."""
        want = self.frame_samples - self.staged
        pieces, consumed, finished = [], [], []
        owner = None
        while want:
            chunk = self.items[0]
            piece = chunk.samples[chunk.offset : chunk.offset + want]
            chunk.offset += piece.shape[0]
            want -= piece.shape[0]
            pieces.append(piece)
            consumed.append((chunk.feed, piece.shape[0]))
            owner = chunk
            if not chunk.left:
                finished.append(self.items.popleft())
        self.staged = 0
        self._requeue(now)
        return Frame(np.concatenate(pieces) if len(pieces) > 1 else pieces[0], owner, consumed,
                     finished)

    def take_residual(self) -> tuple[np.ndarray, list[tuple[Any, int]], list[Chunk]]:
        """The partial frame before the head command: it is handed to the stream."""
        pieces, consumed, finished = [], [], []
        while self.items and isinstance(self.items[0], Chunk):
            chunk = self.items.popleft()
            pieces.append(chunk.samples[chunk.offset:])
            consumed.append((chunk.feed, chunk.left))
            chunk.offset = chunk.samples.shape[0]
            finished.append(chunk)
        samples = np.concatenate(pieces) if pieces else np.zeros((0,), np.float32)
        self.staged += samples.shape[0]
        self.queued = 0
        return samples, consumed, finished

    def pop_command(self, now: float) -> Any:
        command = self.items.popleft()
        self._requeue(now)
        return command

    def drop_tag(self, tag: object, now: float) -> tuple[list[tuple[Any, int]], list[Chunk]]:
        """Forget the rest of one append (its frame failed)."""
        consumed, dropped = [], []
        kept: deque[Any] = deque()
        for item in self.items:
            if isinstance(item, Chunk) and item.tag is tag:
                consumed.append((item.feed, item.left))
                dropped.append(item)
            else:
                kept.append(item)
        self.items = kept
        self._requeue(now)
        return consumed, dropped

    def drain(self) -> Iterator[Any]:
        """Every item left (the session is closing)."""
        while self.items:
            yield self.items.popleft()
        self.queued = self.staged = 0
        self.ready_since = None

    def settled(self) -> Iterator[Chunk]:
        """Unanswered pushes left in the queue that can complete no frame without more PCM."""
        if self.frame_ready():
            return
        for item in self.items:
            if not isinstance(item, Chunk):
                return
            if item.reply is not None:
                yield item

    def _requeue(self, now: float) -> None:
        queued = 0
        for item in self.items:
            if not isinstance(item, Chunk):
                break
            queued += item.left
        self.queued = queued
        if not self.frame_ready():
            self.ready_since = None
        elif self.ready_since is None:
            self.ready_since = now


class StepCosts:
    """Measured wall seconds of a step by its batch size (moving averages)."""

    def __init__(self) -> None:
        self.by_size: dict[int, float] = {}

    def record(self, size: int, seconds: float) -> None:
        if size < 1:
            return
        old = self.by_size.get(size)
        self.by_size[size] = seconds if old is None else \
            old + STEP_SMOOTHING * (seconds - old)

    def solo(self) -> float | None:
        """One session's frame alone: the smallest batch measured (at least its cost)."""
        return self.by_size[min(self.by_size)] if self.by_size else None


class BatchScheduler:
    """When the ready sessions step: all streaming ones ready, or the collection deadline."""

    def __init__(self, batch_wait: float, frame_seconds: float, fill: bool = True,
                 costs: StepCosts | None = None):
        if batch_wait < 0:
            raise ValueError(f"batch_wait must be >= 0 seconds, got {batch_wait!r}")
        self.batch_wait = batch_wait
        self.frame_seconds = frame_seconds
        self.fill = fill
        self.costs = costs if costs is not None else StepCosts()
        self.free_since = time.perf_counter()  # when the engine last finished work

    def ready(self, inputs: dict[str, SessionInput]) -> list[str]:
        return [k for k, v in inputs.items() if v.frame_ready()]

    def collection_start(self, inputs: dict[str, SessionInput], ready: list[str]) -> float:
        """Since when ready frames have waited with the engine free to run them."""
        oldest = min(inputs[k].ready_since or self.free_since for k in ready)
        return max(oldest, self.free_since)

    def filling(self, sessions: int) -> bool:
        """Whether ``sessions`` frames run one by one would leave the engine no time to spare."""
        solo = self.costs.solo()
        return self.fill and solo is not None \
            and sessions * solo > FILL_LOAD * self.frame_seconds

    def wait(self, inputs: dict[str, SessionInput], now: float) -> float | None:
        """Seconds until the next step is due (0: now), ``None`` when no frame is ready."""
        ready = self.ready(inputs)
        if not ready:
            return None
        streaming = {k for k, v in inputs.items() if v.expected(now, self.frame_seconds)}
        if streaming <= set(ready):
            return 0.0
        if self.filling(len(streaming | set(ready))):
            oldest = min(inputs[k].ready_since or self.free_since for k in ready)
            due = oldest + (1.0 - FILL_MARGIN) * self.frame_seconds
        elif self.batch_wait == 0.0:
            return 0.0
        else:
            due = self.collection_start(inputs, ready) + self.batch_wait
        return max(due - now, 0.0)

    def record(self, size: int, seconds: float) -> None:
        """A step of ``size`` frames took ``seconds`` of wall time."""
        self.costs.record(size, seconds)
