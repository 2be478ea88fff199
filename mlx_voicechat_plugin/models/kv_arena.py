"""One attention layer's KV rings of many sessions as one array: one write and one core a step.

A session's attention layer keeps its keys and values in a ring of ``M``
positions (:class:`RingCache`: the bounded context's ring, or a sliding
layer's own window), allocated :attr:`RingCache.growth` positions at a time as
it fills (mlx-lm's ``step``), so a short conversation holds what it wrote, not
the whole ring. When ``S`` sessions step together, each layer would write ``S`` rings and run ``S``
attention cores: two cache writes and a core per row, launches that grow with
the batch. A :class:`KVArena` holds the ``S`` rings of one layer stacked in
one ``[G * S, H, M, D]`` array (row ``j * S + s``: row ``j`` of session ``s``,
the batch layout of the step; ``G`` rows a session, 2 for the backbone's
``[cond; uncond]``; a ring not yet whole is completed to its ``M`` positions
when it is stacked, :meth:`RingCache.complete`). The batch that steps the
sessions stacks it when its rows change (:meth:`KVArena.merge`, mlx-lm's
``merge`` and ``extend``; :meth:`~KVArena.filter`; :meth:`~KVArena.extract`)
and hands it to the layers, which use it as they are given: each step writes
every row's new position with one scatter (at each ring's own write index),
and attends with one ``scaled_dot_product_attention`` over the first ``L``
positions (``L`` the longest ring's length), rows shorter than ``L`` masked.
Rings that are all full need no mask.

Exactness: the scatter writes each row exactly where the ring's own
``update_and_fetch`` would (the arena keeps each ring's bookkeeping,
``offset`` and the write index, on the host as mlx-lm's ``RotatingKVCache``
does), so the stored keys and values are the same bits. A masked row's core
adds exact zeros for the masked positions; on MLX's CPU backend (x86) the
batched core equals each row's own core bit for bit (``tests/test_kv_arena.py``
checks it over lengths, heads and dtypes, and the pool's solo-vs-batched tests
run through it). A GPU kernel may order the reduction differently for a
longer masked row: ``MLX_VOICECHAT_PER_ROW_ATTENTION=1`` (or
:attr:`ArenaAttention.batched` off, :meth:`~.model.Model.set_batched_cores`) keeps
the arena's single write but runs each row's core on its own ring, the exact
path (``conformance/README.md``).

An arena belongs to the batch whose rows it holds, not to the model;
:class:`ArenaAttention`, the model's part, keeps nothing between calls. While
stacked, a row's own :class:`RingCache` holds no arrays: the arena's are the
only copy, and each step's scatter updates them in place.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_vlm.models.cache import RotatingKVCache

ENV_PER_ROW = "MLX_VOICECHAT_PER_ROW_ATTENTION"


def batched_by_default() -> bool:
    """Whether arenas attend all their rows in one core unless told otherwise (the
    environment's ``MLX_VOICECHAT_PER_ROW_ATTENTION`` turns it off)."""
    return os.environ.get(ENV_PER_ROW, "") not in ("1", "true", "yes")


class RingCache(RotatingKVCache):
    """mlx-lm's ``RotatingKVCache(max_size, keep)`` allocated :attr:`growth` positions
    at a time (its ``step``), which a :class:`KVArena` may stack once whole
    (:meth:`complete`). Returns the same keys and values as ``RotatingKVCache``
    (which returns the rows written, whatever its buffer's size)."""

    # Positions allocated at a time (mlx-lm's default step): a ring grows by at most this
    # much as it fills, one copy each time, until it is whole.
    growth = 256

    @property  # type: ignore[override]
    def step(self) -> int:
        # RotatingKVCache grows by ``min(step, max_size - offset)`` as it fills.
        return min(self.growth, self.max_size)

    def complete(self) -> None:
        """Allocate the rest of the ring now (zeros past the rows written, as a growth
        would), so every later one-position write lands inside it. Only before the
        ring wraps, which it cannot do before it is whole."""
        if self.keys is None or self.keys.shape[2] == self.max_size:
            return
        pad = [(0, 0), (0, 0), (0, self.max_size - self.keys.shape[2]), (0, 0)]
        self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)


class KVArena:
    """The rings of ``S`` rows' caches of one layer, ``G`` rows each, as one array.

    Made when a batch stacks its rows (:meth:`merge`); while stacked, a row's
    :class:`RingCache` holds no arrays (its keys are ``None``): the arena is the
    only copy, and :meth:`extract` writes a row back into its cache.
    """

    def __init__(self, caches: list[RingCache], keys: mx.array, values: mx.array,
                 offsets: list[int], idx: list[int], group: int):
        self.caches, self.keys, self.values, self.group = caches, keys, values, group
        self.offsets, self._idx = offsets, idx  # the rings' host bookkeeping, one a row
        self.max_size, self.keep = caches[0].max_size, caches[0].keep  # as the rings name them

    @staticmethod
    def fits(parts: Sequence[Any], group: int) -> bool:
        """Whether ``parts`` (arenas, and rings written at least once) stack as one arena:
        two or more rows of rings of one size, sink, heads, width and dtype."""
        shapes = set()
        for part in parts:
            if isinstance(part, RingCache) and part.keys is not None:
                if part.keys.shape[0] != group:
                    return False
            elif not isinstance(part, KVArena):
                return False
            keys = part.keys
            shapes.add((part.max_size, part.keep, keys.shape[1], keys.shape[3], keys.dtype))
        return len(shapes) == 1 and sum(
            p.sessions if isinstance(p, KVArena) else 1 for p in parts) > 1

    @classmethod
    def merge(cls, parts: Sequence[Any], group: int) -> "KVArena":
        """One arena of ``parts``' rows in order (arenas' rows, and rings completed to
        their whole size, which give their arrays up): a copy."""
        arenas = []  # each part as an arena: a ring, completed, is one of one row
        for part in parts:
            if not isinstance(part, KVArena):
                part.complete()
                part = cls([part], part.keys, part.values, [part.offset], [part._idx], group)
                part.caches[0].keys = part.caches[0].values = None  # the arena's rows now
            arenas.append(part)
        flat = [mx.concatenate([a._grouped(getattr(a, name)) for a in arenas], axis=1)
                for name in ("keys", "values")]
        return cls([c for a in arenas for c in a.caches],
                   *(a.reshape(-1, *a.shape[2:]) for a in flat),
                   [o for a in arenas for o in a.offsets], [i for a in arenas for i in a._idx],
                   group)

    def _grouped(self, array: mx.array) -> mx.array:
        """``[G * S, ...]`` as ``[G, S, ...]`` (row ``j * S + s``: row ``j`` of ring ``s``)."""
        return array.reshape(self.group, self.sessions, *array.shape[1:])

    @property
    def sessions(self) -> int:
        return len(self.caches)

    @property
    def state(self) -> list[mx.array]:
        return [self.keys, self.values]

    def row_nbytes(self, slot: int) -> int:
        """The bytes of row ``slot``'s ``state`` (the first ``min(offset, M)`` positions,
        as ``RotatingKVCache.state`` slices them), from shapes alone."""
        heads, ring, width = self.keys.shape[1:]
        return 2 * self.group * heads * min(self.offsets[slot], ring) * width * self.keys.itemsize

    def extract(self, slot: int, copy: bool = True) -> RingCache:
        """Row ``slot`` written back into its own cache: copies (only the :attr:`growth`
        steps a ring that has not wrapped wrote into, as it held them before it was
        completed), or ``copy=False`` views, for a row stacked again at once."""
        cache = self.caches[slot]
        keys, values = (self._grouped(a)[:, slot] for a in (self.keys, self.values))
        offset = self.offsets[slot]
        if copy:  # a ring that wrapped keeps all of it (a whole-ring slice is no op)
            size = min(self.max_size, max(1, -(-offset // cache.step)) * cache.step)
            keys, values = keys[:, :, :size], values[:, :, :size]
            keys, values = mx.contiguous(keys), mx.contiguous(values)
        cache.keys, cache.values, cache.offset, cache._idx = keys, values, offset, self._idx[slot]
        return cache

    def split(self) -> list[RingCache]:
        """Every row written back into its cache as views (stacked again at once)."""
        return [self.extract(s, copy=False) for s in range(self.sessions)]

    def filter(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep``, renumbered (mlx-lm's ``filter``: a copy)."""
        index = mx.array(list(keep))
        self.keys, self.values = (mx.take(self._grouped(a), index, axis=1).reshape(
            -1, *a.shape[1:]) for a in (self.keys, self.values))
        self.offsets = [self.offsets[s] for s in keep]
        self._idx = [self._idx[s] for s in keep]
        self.caches = [self.caches[s] for s in keep]

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               batched: bool, memo: StepArrays | None = None) -> mx.array:
        """Write one position of every row and attend: ``[G * S, H, 1, D]`` in, same out.

        The write index and length of each ring advance on the host exactly
        as ``RotatingKVCache``'s one-position write into a whole ring does (past
        the end, back to the kept sink), for all rows at once. ``memo``: the
        step's write indices and masks, shared by its layers whose rings agree.
        """
        ring, keep = self.max_size, self.keep
        positions = [keep if i == ring else i for i in self._idx]  # rotate past the sink
        self._idx = [p + 1 for p in positions]
        self.offsets = offsets = [o + 1 for o in self.offsets]
        lengths = [o if o < ring else ring for o in offsets]  # RotatingKVCache.size()
        index, mask = step_arrays(tuple(positions), tuple(lengths), self.group,
                                  {} if memo is None else memo)
        self.keys = mx.put_along_axis(self.keys, index, keys, axis=2)
        self.values = mx.put_along_axis(self.values, index, values, axis=2)
        if not batched:
            return self._per_row(queries, scale, lengths)
        longest = max(lengths)  # a slice of the whole ring is the ring itself (no op)
        return mx.fast.scaled_dot_product_attention(
            queries, self.keys[:, :, :longest], self.values[:, :, :longest], scale=scale,
            mask=mask)

    def _per_row(self, queries: mx.array, scale: float, lengths: list[int]) -> mx.array:
        """Each row's core on its own ring (the exact path on any backend)."""
        sessions = self.sessions
        keys, values = self._grouped(self.keys), self._grouped(self.values)
        outs = [mx.fast.scaled_dot_product_attention(
            queries[slot::sessions], keys[:, slot, :, :length], values[:, slot, :, :length],
            scale=scale)[:, None] for slot, length in enumerate(lengths)]
        joined = mx.concatenate(outs, axis=1)  # [G, S, ...]: row j of session s -> j * S + s
        return joined.reshape(-1, *joined.shape[2:])


def stack_layer(parts: Sequence[Any], group: int) -> Any:
    """One layer's caches of a batch's rows (``parts``: arenas, caches, lists of caches):
    one :class:`KVArena` where they fit, else the list of every row's cache."""
    if KVArena.fits(parts, group):
        return KVArena.merge(parts, group)
    return [c for p in parts for c in (
        p.split() if isinstance(p, KVArena) else p if isinstance(p, list) else [p])]


# One step's write indices and masks by (positions, lengths, group): made by the
# step (one per call of a stack's step) and dropped with it.
StepArrays = dict


def step_arrays(positions: tuple[int, ...], lengths: tuple[int, ...], group: int,
                memo: StepArrays) -> tuple[mx.array, mx.array | None]:
    """The write index ``[G * S, 1, 1, 1]`` and the mask (None when every ring is
    as long as the longest) of a step's rings. The layers of a step whose rings
    agree (every global layer of a stack, every sliding one) share one pair
    through the step's ``memo`` instead of each building its own from the host."""
    key = (positions, lengths, group)
    found = memo.get(key)
    if found is None:
        index = mx.array(positions * group, dtype=mx.int32).reshape(-1, 1, 1, 1)
        longest = max(lengths)
        mask = None
        if min(lengths) < longest:
            rows = np.array(lengths * group)[:, None]
            mask = mx.array(np.arange(longest)[None, :] < rows).reshape(len(rows), 1, 1, longest)
        found = memo[key] = (index, mask)
    return found


class ArenaAttention:
    """A stack's attention layers over the rows of a step: one write and core through the
    rows' :class:`KVArena` where their batch stacked one, else each row on its own
    cache (``alone``).

    Holds only a setting (:attr:`batched`): a step attends through what it is handed.
    """

    def __init__(self, batched: bool | None = None) -> None:
        self.batched = batched_by_default() if batched is None else batched

    def __call__(self, queries: mx.array, keys: mx.array, values: mx.array, caches: Any,
                 scale: float, alone: Callable[[], mx.array],
                 memo: StepArrays | None = None) -> mx.array:
        if isinstance(caches, KVArena):
            return caches.attend(queries, keys, values, scale, self.batched, memo)
        return alone()


def ring_offsets(caches: Any) -> tuple[int, ...]:
    """Each row's ``offset``: an arena's list, or each cache's."""
    if isinstance(caches, KVArena):
        return tuple(caches.offsets)
    return tuple(c.offset for c in caches)
