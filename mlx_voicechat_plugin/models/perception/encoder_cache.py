"""The conformer's streaming state of ``B`` streams: per-layer windows and the subsampling tail.

:class:`EncoderCache` holds, per layer, the attention window (``[B, W, 2d]``
projected keys and values, or ``[B, W, d]`` inputs without ``cache_kv``) and
the depthwise-conv context (``[B, kernel - 1, d]``), ``None`` until the
streams' first frame; the subsampling stack's kept mel frames
(``[B, kept, F]``); and each stream's :class:`SubsamplingTail` (host
counters). It follows mlx-lm's cache convention: ``state`` lists its arrays,
``merge`` stacks streams' caches of equal :meth:`~EncoderCache.key`,
``extract(i)`` hands row ``i`` back. One stream is ``B = 1``, where both move
no data. Whoever steps the same streams frame after frame keeps their merged
cache between frames (the runtime's batch), so a steady frame stacks nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..rows import keep_rows, own_row, stack_rows


@dataclass
class SubsamplingTail:
    """One stream's streaming subsampling counters (its kept mel frames are its row of
    :attr:`EncoderCache.kept`)."""

    consumed: int = 0  # mel frames pushed so far
    emitted: int = 0  # encoder frames returned so far


def _stack(parts: tuple) -> mx.array | None:
    return None if parts[0] is None else stack_rows(parts)


class EncoderCache:
    """``B`` streams' encoder state: per layer the attention window and the conv context,
    the kept mel frames, and each stream's :class:`SubsamplingTail`."""

    def __init__(self, layers: int, tails: list[SubsamplingTail] | None = None):
        self.attention: list[mx.array | None] = [None] * layers
        self.conv: list[mx.array | None] = [None] * layers
        self.kept: mx.array | None = None  # (B, kept mel frames, F)
        self.tails = [SubsamplingTail()] if tails is None else tails

    @property
    def batch_size(self) -> int:
        return len(self.tails)

    @property
    def state(self) -> list[mx.array]:
        """The windows (once the first frame ran), then the kept mel frames."""
        windows = [] if self.attention[0] is None else [*self.attention, *self.conv]
        return windows if self.kept is None else [*windows, self.kept]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        layers = len(self.attention)
        windows = len(arrays) > 1
        self.attention = list(arrays[:layers]) if windows else [None] * layers
        self.conv = list(arrays[layers : 2 * layers]) if windows else [None] * layers
        kept = arrays[2 * layers :] if windows else arrays
        self.kept = kept[0] if kept else None

    @property
    def nbytes(self) -> int:
        """The bytes of ``state``."""
        return sum(a.nbytes for a in self.state)

    @property
    def row_nbytes(self) -> int:
        """The bytes of one row's state (rows of one cache having equal shapes)."""
        return self.nbytes // self.batch_size

    def key(self) -> tuple:
        """What must be equal for caches to merge: each window's and the kept frames' shape."""
        return (tuple(None if a is None else a.shape[1:] for a in self.attention),
                tuple(None if c is None else c.shape[1:] for c in self.conv),
                None if self.kept is None else self.kept.shape[1:])

    # --- rows -----------------------------------------------------------------------

    @classmethod
    def merge(cls, caches: list["EncoderCache"]) -> "EncoderCache":
        """One cache whose rows are ``caches``' rows, in order (equal :meth:`key`; one
        cache: itself)."""
        if len(caches) == 1:
            return caches[0]
        merged = cls(len(caches[0].attention), [t for c in caches for t in c.tails])
        merged.attention = [_stack(parts) for parts in zip(*(c.attention for c in caches))]
        merged.conv = [_stack(parts) for parts in zip(*(c.conv for c in caches))]
        merged.kept = _stack(tuple(c.kept for c in caches))
        return merged

    def extract(self, index: int, copy: bool = True) -> "EncoderCache":
        """Row ``index`` as a one-stream cache (a one-stream cache: itself; ``copy=False``:
        slices, for a row stacked again)."""
        if self.batch_size == 1:
            return self
        return self._rows([index], lambda a: own_row(a, index, copy))

    def filter(self, keep: list[int]) -> "EncoderCache":
        """Rows ``keep`` (ascending) as one cache, one gather per array (copies)."""
        return self._rows(keep, lambda a: keep_rows(a, keep))

    def _rows(self, rows: list[int], take: Callable[[mx.array], mx.array]) -> "EncoderCache":
        """A cache of rows ``rows``: ``take`` of each array (one not made yet stays ``None``)."""
        out = EncoderCache(len(self.attention), [self.tails[b] for b in rows])

        def each(array: mx.array | None) -> mx.array | None:
            return None if array is None else take(array)

        out.attention = [each(a) for a in self.attention]
        out.conv = [each(c) for c in self.conv]
        out.kept = each(self.kept)
        return out
