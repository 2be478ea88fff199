"""The conformer's streaming state of ``B`` streams: per-layer windows and each stream's tail.

:class:`EncoderCache` holds, per layer, the attention window (``[B, W, 2d]``
projected keys and values, or ``[B, W, d]`` inputs without ``cache_kv``) and
the depthwise-conv context (``[B, kernel - 1, d]``), ``None`` until a
stream's first frame, and each stream's :class:`SubsamplingTail` (host
counters and a short mel window, a row's own piece, never stacked). It
follows mlx-lm's cache convention: ``state`` lists its arrays, ``merge``
stacks streams' caches, ``split`` (or ``extract(i)``) hands the rows back.

A pool steps the same streams frame after frame, so a batch's rows are
merged again at the next frame in the same order. :meth:`EncoderCache.split`
therefore hands back rows that still share the batch's windows (one
:class:`_Batch` per split, no array made per row and layer), and
:meth:`EncoderCache.merge` of all of a batch's rows, in order, is that
batch's windows again. A row that is read on its own (``attention``,
``conv``, ``state``) takes its slices then (:func:`~.rows.take_row`); sizing
one (``nbytes``) and comparing shapes (``key``) take none.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .rows import LinkedRow, stack_rows, take_row


@dataclass
class SubsamplingTail(LinkedRow):
    """One stream's streaming subsampling: the mel frames it still reads, and its counters
    (``cache`` may be a row of a batch's kept frames, linked to it: :class:`~.rows.LinkedRow`)."""

    cache: mx.array | None = None  # (1, kept mel frames, F)
    consumed: int = 0  # mel frames pushed so far
    emitted: int = 0  # encoder frames returned so far
    first: int = 0  # encoder frame index of the last window's first output


class _Batch:
    """The windows of a batch after a step, shared by its rows until one is read alone."""

    __slots__ = ("attention", "conv", "rows", "row_nbytes")

    def __init__(self, attention: list[mx.array | None], conv: list[mx.array | None],
                 rows: int):
        self.attention, self.conv, self.rows = tuple(attention), tuple(conv), rows
        # A row's share of the windows, sized once for all of its rows.
        self.row_nbytes = sum(a.nbytes for a in (*attention, *conv) if a is not None) // rows


def _windows_of(name: str) -> property:
    """An :class:`EncoderCache` list of windows, read (or replaced) as the row's own."""

    def get(cache: "EncoderCache") -> list[mx.array | None]:
        cache._own()
        return getattr(cache, name)

    def put(cache: "EncoderCache", value: list[mx.array | None]) -> None:
        cache._own()
        setattr(cache, name, value)

    return property(get, put)


class EncoderCache:
    """``B`` streams' encoder state: per layer the attention window and the conv context,
    and each stream's :class:`SubsamplingTail`."""

    def __init__(self, layers: int, tails: list[SubsamplingTail] | None = None):
        self._attention: list[mx.array | None] = [None] * layers
        self._conv: list[mx.array | None] = [None] * layers
        self.tails = [SubsamplingTail()] if tails is None else tails
        self._batch: _Batch | None = None  # a row of this batch, not yet read alone
        self._row = 0

    # --- windows ----------------------------------------------------------------

    def _own(self) -> None:
        """A row of a batch takes its slices of the batch's windows."""
        batch, row = self._batch, self._row
        if batch is not None:
            self._batch = None
            self._attention = [None if a is None else take_row(a, row) for a in batch.attention]
            self._conv = [None if c is None else take_row(c, row) for c in batch.conv]

    # Each layer's windows: a row of a batch takes its slices first.
    attention = _windows_of("_attention")
    conv = _windows_of("_conv")

    @property
    def batch_size(self) -> int:
        return len(self.tails)

    @property
    def state(self) -> list[mx.array]:
        """The windows (once the first frame ran), then each stream's subsampling cache."""
        windows = [] if self.attention[0] is None else [*self.attention, *self.conv]
        return [*windows, *(t.cache for t in self.tails if t.cache is not None)]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        layers = len(self.attention)
        windows = len(arrays) > self.batch_size
        self.attention = list(arrays[:layers]) if windows else [None] * layers
        self.conv = list(arrays[layers : 2 * layers]) if windows else [None] * layers
        caches = arrays[2 * layers :] if windows else arrays
        for tail, cache in zip(self.tails, [*caches, *[None] * self.batch_size]):
            tail.cache = cache

    @property
    def nbytes(self) -> int:
        """The bytes of ``state`` (an unread row sized as its share of the batch's windows)."""
        tails = sum(t.cache.nbytes for t in self.tails if t.cache is not None)
        if self._batch is not None:
            return self._batch.row_nbytes + tails
        return tails + sum(a.nbytes for a in (*self._attention, *self._conv) if a is not None)

    @staticmethod
    def carried(caches: list["EncoderCache"]) -> list[mx.array]:
        """Every array ``caches`` hold, each once (a batch's windows and kept mel frames once
        for all of its unread rows): what a frame evaluates with its outputs, without a
        row's slices."""
        found: dict[int, mx.array] = {}  # by id: each array once
        for cache in caches:
            batch = cache._batch
            if batch is None:
                found.update((id(a), a) for a in cache.state)
                continue
            if batch.attention[0] is not None:
                found.update((id(a), a) for a in (*batch.attention, *batch.conv))
            for tail in cache.tails:  # a tail still holding its batch's row: that batch's array
                kept = tail.whole(tail.cache)
                if kept is not None:
                    found[id(kept)] = kept
        return list(found.values())

    def key(self) -> tuple:
        """What must be equal for caches to merge: each window's shape."""
        held = self._batch  # an unread row: its batch's windows
        attention, conv = (self._attention, self._conv) if held is None else (held.attention,
                                                                              held.conv)
        return (tuple(None if a is None else a.shape[1:] for a in attention),
                tuple(None if c is None else c.shape[1:] for c in conv))

    # --- rows -----------------------------------------------------------------------

    @classmethod
    def merge(cls, caches: list["EncoderCache"]) -> "EncoderCache":
        """One cache whose rows are ``caches``' rows, in order (equal :meth:`key`)."""
        tails = [t for c in caches for t in c.tails]
        batch = caches[0]._batch
        if batch is not None and batch.rows == len(caches) and all(
                c._batch is batch and c._row == j for j, c in enumerate(caches)):
            merged = cls(len(batch.attention), tails)  # every row of one batch, in order
            merged._attention, merged._conv = list(batch.attention), list(batch.conv)
            return merged
        merged = cls(len(caches[0].attention), tails)
        merged._attention = [None if parts[0] is None else stack_rows(parts)
                             for parts in zip(*(c.attention for c in caches))]
        merged._conv = [None if parts[0] is None else stack_rows(parts)
                        for parts in zip(*(c.conv for c in caches))]
        return merged

    def split(self) -> list["EncoderCache"]:
        """Every row as a one-stream cache, sharing this cache's windows until read."""
        if self.batch_size == 1:
            return [self]
        batch = _Batch(self.attention, self.conv, self.batch_size)
        rows = []
        for j, tail in enumerate(self.tails):
            row = EncoderCache(0, [tail])
            row._batch, row._row = batch, j
            rows.append(row)
        return rows

    def extract(self, index: int) -> "EncoderCache":
        """Row ``index`` as a one-stream cache."""
        row = EncoderCache(len(self.attention), [self.tails[index]])
        row.attention = [None if a is None else take_row(a, index) for a in self.attention]
        row.conv = [None if c is None else take_row(c, index) for c in self.conv]
        return row
