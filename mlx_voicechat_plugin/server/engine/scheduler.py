"""The rule that turns the sessions' channels into batched pool steps (engine thread).

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

from .channel import StreamChannel

# A session that sent nothing for this many frames is not waited for.
EXPECT_FRAMES = 2
# Batches fill once the streaming sessions' frames run alone would take this share of a frame.
FILL_LOAD = 0.75
# A filled step is due this share of a frame before the oldest frame's period ends.
FILL_MARGIN = 0.125
# Weight of the newest step in the step-time averages.
STEP_SMOOTHING = 0.2


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
        self.batch_wait = batch_wait
        self.frame_seconds = frame_seconds
        self.fill = fill
        self.costs = costs if costs is not None else StepCosts()
        self.free_since = time.perf_counter()  # when the engine last finished work

    def ready(self, channels: dict[str, StreamChannel]) -> list[str]:
        return [k for k, v in channels.items() if v.frame_ready()]

    def collection_start(self, channels: dict[str, StreamChannel], ready: list[str]) -> float:
        """Since when ready frames have waited with the engine free to run them."""
        oldest = min(channels[k].ready_since or self.free_since for k in ready)
        return max(oldest, self.free_since)

    def filling(self, sessions: int) -> bool:
        """Whether ``sessions`` frames run one by one would leave the engine no time to spare."""
        solo = self.costs.solo()
        return self.fill and solo is not None \
            and sessions * solo > FILL_LOAD * self.frame_seconds

    def wait(self, channels: dict[str, StreamChannel], now: float) -> float | None:
        """Seconds until the next step is due (0: now), ``None`` when no frame is ready."""
        ready = self.ready(channels)
        if not ready:
            return None
        expect = EXPECT_FRAMES * self.frame_seconds
        streaming = {k for k, v in channels.items() if now - v.last_arrival <= expect}
        if streaming <= set(ready):
            return 0.0
        if self.filling(len(streaming | set(ready))):
            oldest = min(channels[k].ready_since or self.free_since for k in ready)
            due = oldest + (1.0 - FILL_MARGIN) * self.frame_seconds
        elif self.batch_wait == 0.0:
            return 0.0
        else:
            due = self.collection_start(channels, ready) + self.batch_wait
        return max(due - now, 0.0)

    def record(self, size: int, seconds: float) -> None:
        """A step of ``size`` frames took ``seconds`` of wall time."""
        self.costs.record(size, seconds)
