"""Per-frame stage timings of a streaming session.

Each stage is timed after forcing evaluation of its outputs, so the figures
are wall-clock work, not graph construction. ``MLX_VOICECHAT_PROFILE_STAGES=1``
adds sub-stages; ``MLX_VOICECHAT_PROFILE_FRAMES=<path>`` writes every frame as
JSON when the session ends.

``host_syncs`` per frame is counted by :class:`HostSyncCounter` (every
``mx.eval``, ``.item()``, ``.tolist()`` and numpy conversion that waits), not
declared; the profiler's own stage barriers are not counted. ``wait_ms`` is
the time spent in those syncs and ``async_eval_ms`` the time ``mx.async_eval``
itself took to return (on the CPU backend it runs much of the work inline).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:  # an instrument: imported only once a profiled frame starts
    from ..instruments.syncs import HostSyncCounter

# The profiler's barriers use MLX's own eval, never the counting wrapper.
_barrier_eval = mx.eval

STAGES = ("perception", "rnnt", "language", "tts", "codec")
ENV_SUB_STAGES = "MLX_VOICECHAT_PROFILE_STAGES"
ENV_FRAMES = "MLX_VOICECHAT_PROFILE_FRAMES"


@dataclass
class FrameTiming:
    frame_index: int
    stages_ms: dict[str, float] = field(default_factory=dict)
    sub_stages_ms: dict[str, float] = field(default_factory=dict)
    total_ms: float = 0.0
    host_syncs: int = 0
    sync_calls: list[str] = field(default_factory=list)
    wait_ms: float = 0.0
    async_eval_ms: float = 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean_ms": _mean(values),
        "p50_ms": float(np.percentile(values, 50)) if values else 0.0,
        "p95_ms": float(np.percentile(values, 95)) if values else 0.0,
        "max_ms": max(values, default=0.0),
    }


class FrameClock:
    """Times the stages of one frame. Disabled clocks cost nothing and sync nothing."""

    def __init__(self, enabled: bool, sub_stages: bool = False):
        self.enabled = enabled
        self.sub_stages = enabled and sub_stages
        self._frame: FrameTiming | None = None
        self._counter: "HostSyncCounter | None" = None
        self._mark = self._sub_mark = self._start = 0.0

    def start(self, frame_index: int) -> None:
        """Begin a frame; end it with :meth:`finish` or, on failure, :meth:`abandon`."""
        if self.enabled:
            from ..instruments.syncs import HostSyncCounter

            self.abandon()
            self._frame = FrameTiming(frame_index)
            self._counter = HostSyncCounter().__enter__()
            self._start = self._mark = self._sub_mark = time.perf_counter()

    def abandon(self) -> None:
        """Drop the frame in progress (it raised) and stop counting."""
        self._frame = None
        self._stop_counting()

    def _stop_counting(self) -> "HostSyncCounter | None":
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
        return counter

    def stage(self, name: str, *arrays: Any) -> None:
        """End stage ``name``: evaluate its outputs and record the elapsed time."""
        if self.enabled and self._frame is not None:
            self._lap(self._frame.stages_ms, name, arrays, self._mark)
            self._mark = self._sub_mark

    def sub_stage(self, name: str, *arrays: Any) -> None:
        """End sub-stage ``name`` (only with ``MLX_VOICECHAT_PROFILE_STAGES=1``)."""
        if self.sub_stages and self._frame is not None:
            self._lap(self._frame.sub_stages_ms, name, arrays, self._sub_mark)

    def _lap(self, book: dict[str, float], name: str, arrays: tuple, since: float) -> None:
        """Evaluate ``arrays`` and add the milliseconds since ``since`` to ``book[name]``."""
        if arrays:
            _barrier_eval(*arrays)
        self._sub_mark = time.perf_counter()
        book[name] = book.get(name, 0.0) + (self._sub_mark - since) * 1e3

    def finish(self) -> FrameTiming | None:
        frame, self._frame = self._frame, None
        counter = self._stop_counting()
        if frame is None or counter is None:
            return None
        frame.total_ms = (time.perf_counter() - self._start) * 1e3
        frame.host_syncs = counter.count
        frame.sync_calls = list(counter.calls)
        frame.wait_ms = counter.wait_ms
        frame.async_eval_ms = counter.async_eval_ms
        return frame


# The default of every step's ``clock``: disabled, it times and keeps nothing.
NO_CLOCK = FrameClock(enabled=False)


@dataclass
class Profile:
    frame_duration_ms: float
    frames: list[FrameTiming] = field(default_factory=list)

    def summary(self, drop_first: int = 0) -> dict[str, Any]:
        frames = self.frames[drop_first:]
        stages = {s: _stats([f.stages_ms.get(s, 0.0) for f in frames]) for s in STAGES}
        stages["total"] = _stats([f.total_ms for f in frames])
        mean_total = stages["total"]["mean_ms"]
        result: dict[str, Any] = {
            "frames": len(frames),
            "dropped_cold_frames": min(drop_first, len(self.frames)),
            "frame_duration_ms": self.frame_duration_ms,
            "processing_frames_per_second": 1000.0 / mean_total if mean_total else 0.0,
            "realtime_factor": mean_total / self.frame_duration_ms,
            "host_syncs": _mean([f.host_syncs for f in frames]),
            "wait_ms": _mean([f.wait_ms for f in frames]),
            "async_eval_ms": _mean([f.async_eval_ms for f in frames]),
            "stages": stages,
        }
        names = sorted({n for f in frames for n in f.sub_stages_ms})
        if names:
            result["sub_stages"] = {n: _stats([f.sub_stages_ms.get(n, 0.0) for f in frames]) for n in names}
        return result

    def write_frames(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps([asdict(f) for f in self.frames], indent=1))


def profile_env() -> tuple[bool, str | None]:
    """``(sub_stages, frames_path)`` from the environment."""
    return os.environ.get(ENV_SUB_STAGES, "") == "1", os.environ.get(ENV_FRAMES) or None
