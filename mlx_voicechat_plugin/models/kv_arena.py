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
when an arena adopts it, :meth:`RingCache.complete`) and keeps it across steps while the same sessions step in
the same order (the steady state of a pool): each step writes every row's new
position with one scatter (at each ring's own write index), and attends
with one ``scaled_dot_product_attention`` over the first ``L`` positions
(``L`` the longest ring's length), rows shorter than ``L`` masked. Rings that
are all full need no mask. When the sessions change, the arena is rebuilt
from the rows (one copy), and a session that leaves takes its rows back.

Exactness: the scatter writes each row exactly where the ring's own
``update_and_fetch`` would (:class:`RingCache` keeps its bookkeeping,
``offset`` and the write index, on the host as mlx-lm's ``RotatingKVCache``
does), so the stored keys and values are the same bits. A masked row's core
adds exact zeros for the masked positions; on MLX's CPU backend (x86) the
batched core equals each row's own core bit for bit (``tests/test_kv_arena.py``
checks it over lengths, heads and dtypes, and the pool's solo-vs-batched tests
run through it). A GPU kernel may order the reduction differently for a
longer masked row: ``MLX_VOICECHAT_PER_ROW_ATTENTION=1`` (or
:attr:`AttentionCores.batched` off, :meth:`~.model.Model.set_batched_cores`) keeps
the arena's single write but runs each row's core on its own ring, the exact
path (``conformance/README.md``).

An arena belongs to the rows it holds, not to the model (:attr:`RingCache.arena`);
:class:`AttentionCores`, the model's part, keeps nothing between calls.

A cache adopted by an arena holds no arrays of its own: reading ``keys`` or
``state`` gives views of its rows; anything that writes through the cache
(``update_and_fetch``, ``state = ...``) first takes its rows back
(:meth:`RingCache.detach`). So the arena's arrays have one owner and each
step's scatter updates them in place.
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


def _ring_part(index: int, name: str) -> property:
    """A :class:`RingCache` attribute (``index`` of :meth:`KVArena.row`): read from its
    arena while adopted; setting it takes the rows back first."""

    def get(cache: "RingCache") -> mx.array | None:
        arena = cache._arena
        return arena.row(cache._slot)[index] if arena is not None else getattr(cache, name)

    def put(cache: "RingCache", value: mx.array | None) -> None:
        cache.detach()
        setattr(cache, name, value)

    return property(get, put)


def _ring_count(name: str) -> property:
    """A :class:`RingCache` host counter (``offset`` / ``_idx``): while adopted, its
    arena's entry for it (the arena advances all its rows' counters at once each
    step, one list a step, not a call per row and layer), else its own."""
    own = "_own" + name

    def get(cache: "RingCache") -> int:
        arena = cache._arena
        return getattr(arena, name)[cache._slot] if arena is not None else getattr(cache, own)

    def put(cache: "RingCache", value: int) -> None:
        arena = cache._arena
        if arena is not None:
            getattr(arena, name)[cache._slot] = value
        else:
            setattr(cache, own, value)

    return property(get, put)


class RingCache(RotatingKVCache):
    """mlx-lm's ``RotatingKVCache(max_size, keep)`` allocated :attr:`growth` positions
    at a time (its ``step``), which a :class:`KVArena` may adopt once whole
    (:meth:`complete`). Returns the same keys and values as ``RotatingKVCache``
    (which returns the rows written, whatever its buffer's size)."""

    # Positions allocated at a time (mlx-lm's default step): a ring grows by at most this
    # much as it fills, one copy each time, until it is whole.
    growth = 256
    _arena: "KVArena | None" = None
    _slot = 0
    _keys: mx.array | None = None
    _values: mx.array | None = None
    _own_offset = 0
    _own_idx = 0
    # ``RotatingKVCache``'s host bookkeeping, kept by the arena while adopted.
    offset = _ring_count("_offset")  # type: ignore[assignment]
    _idx = _ring_count("_idx")  # type: ignore[assignment]

    @property  # type: ignore[override]
    def step(self) -> int:
        # RotatingKVCache grows by ``min(step, max_size - offset)`` as it fills.
        return min(self.growth, self.max_size)

    def complete(self) -> None:
        """Allocate the rest of the ring now (zeros past the rows written, as a growth
        would), so every later one-position write lands inside it. Only before the
        ring wraps, which it cannot do before it is whole."""
        if self.whole or self._keys is None:
            return
        pad = [(0, 0), (0, 0), (0, self.max_size - self._keys.shape[2]), (0, 0)]
        self._keys, self._values = mx.pad(self._keys, pad), mx.pad(self._values, pad)

    # ``keys`` / ``values``: views of its arena rows while adopted, else its own arrays.
    keys = _ring_part(0, "_keys")
    values = _ring_part(1, "_values")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.detach()
        return super().update_and_fetch(keys, values)

    @property
    def state_nbytes(self) -> int:
        """The bytes of ``state`` (the first ``min(offset, M)`` positions of the keys and
        values, as ``RotatingKVCache.state`` slices them), from shapes alone: no view of
        the arena is made."""
        if self._arena is None:
            return sum(a.nbytes for a in self.state if a is not None)
        heads, ring, width = self._arena.keys.shape[1:]
        rows = self._arena.group if self._arena.group > 1 else 1
        positions = self.offset if self.offset < ring else ring
        return 2 * rows * heads * positions * width * self._arena.keys.itemsize

    @property
    def arena(self) -> "KVArena | None":
        """The arena holding its rows, if one does."""
        return self._arena

    def adopt(self, arena: "KVArena", slot: int) -> None:
        """Its rows are now ``arena``'s row ``slot`` (it holds no arrays of its own)."""
        self.detach(keep=False)
        self._keys = self._values = None
        self._arena, self._slot = arena, slot

    @property
    def whole(self) -> bool:
        """Its ring is allocated whole (every later one-position write lands inside it)."""
        return self._arena is not None or (
            self._keys is not None and self._keys.shape[2] == self.max_size)

    def detach(self, keep: bool = True, copy: bool = True) -> None:
        """Take its rows back from its arena (copies of them, so they do not keep the
        arena's buffer alive; ``copy=False``: views, for rows stacked again at once;
        ``keep=False``: drop them) and its write index and offset. A ring that has
        not wrapped copies only the :attr:`growth` steps it wrote into, as it held
        them before the arena completed it (the rest are the completion's zeros)."""
        arena = self._arena
        if arena is not None:
            offset = self._own_offset = arena._offset[self._slot]
            self._own_idx = arena._idx[self._slot]
            self._arena = None
            keys, values = arena.leave(self._slot)
            if keep and copy:
                if offset < self.max_size:
                    size = min(self.max_size, max(1, -(-offset // self.step)) * self.step)
                    keys, values = keys[:, :, :size], values[:, :, :size]
                keys, values = mx.contiguous(keys), mx.contiguous(values)
            self._keys, self._values = (keys, values) if keep else (None, None)


def release(caches: Sequence[Any], keep: bool = False) -> None:
    """A session's caches leave their arenas: dropped, or with ``keep`` taken back as
    copies; the others stay stacked without its slot (:meth:`KVArena.filter`)."""
    for cache in caches:
        if isinstance(cache, RingCache):
            arena = cache.arena
            cache.detach(keep=keep)
            if arena is not None:
                arena.filter()


class KVArena:
    """The rings of ``S`` sessions' caches of one layer, ``G`` rows each, as one array."""

    def __init__(self, caches: Sequence[RingCache], group: int):
        keys = [c.keys for c in caches]
        values = [c.values for c in caches]
        self.caches: list[RingCache | None] = list(caches)
        self.group = group
        # The rings' host bookkeeping, one entry a row (read through each cache's
        # ``offset`` / ``_idx`` while adopted); every ring has one size and sink.
        self._offset = [c.offset for c in caches]
        self._idx = [c._idx for c in caches]
        self.ring, self.keep = caches[0].max_size, caches[0].keep
        if any(c.max_size != self.ring or c.keep != self.keep for c in caches):
            raise ValueError("an arena's rings must have one size and one kept sink")
        self.keys: mx.array | None = self._stack(keys)
        self.values: mx.array | None = self._stack(values)
        for slot, cache in enumerate(caches):
            cache.adopt(self, slot)

    def _stack(self, rows: list[mx.array]) -> mx.array:
        if self.group == 1:
            return mx.concatenate(rows)
        return mx.stack(rows, axis=1).reshape(-1, *rows[0].shape[1:])  # row j * S + s

    @property
    def sessions(self) -> int:
        return len(self.caches)

    def holds(self, caches: Sequence[Any]) -> bool:
        """Exactly these caches, in this order, all still adopted (a cache that leaves
        is ``None`` in :attr:`caches`, and one list compares by identity in C)."""
        return (caches if isinstance(caches, list) else list(caches)) == self.caches

    def takes(self, keys: mx.array) -> bool:
        """``keys`` are one new position of every row, of the arena's heads, width and dtype."""
        assert self.keys is not None
        arena = self.keys
        return (keys.shape[2] == 1 and keys.dtype == arena.dtype
                and (keys.shape[0], keys.shape[1], keys.shape[3])
                == (arena.shape[0], arena.shape[1], arena.shape[3]))

    def row(self, slot: int) -> tuple[mx.array, mx.array]:
        """Session ``slot``'s rows, ``[G, H, M, D]`` views of the arena."""
        assert self.keys is not None and self.values is not None
        if self.group == 1:
            return self.keys[slot : slot + 1], self.values[slot : slot + 1]
        shape = (self.group, self.sessions, *self.keys.shape[1:])
        return self.keys.reshape(shape)[:, slot], self.values.reshape(shape)[:, slot]

    def leave(self, slot: int) -> tuple[mx.array, mx.array]:
        """Session ``slot`` takes its rows back; the last one out frees the arena."""
        rows = self.row(slot)
        self.caches[slot] = None
        if all(c is None for c in self.caches):
            self.keys = self.values = None
        return rows

    def filter(self) -> None:
        """Keep the slots still adopted, renumbered (mlx-lm's ``filter``: a copy); a last
        one takes its rows back."""
        keep = [s for s, c in enumerate(self.caches) if c is not None]
        if len(keep) == 1:
            self.caches[keep[0]].detach()  # type: ignore[union-attr]
        if len(keep) in (1, len(self.caches)) or self.keys is None:
            return
        shape = (self.group, self.sessions, *self.keys.shape[1:])
        self.keys, self.values = (mx.take(a.reshape(shape), mx.array(keep), axis=1).reshape(
            -1, *shape[2:]) for a in (self.keys, self.values))
        self._offset = [self._offset[s] for s in keep]
        self._idx = [self._idx[s] for s in keep]
        self.caches = [self.caches[s] for s in keep]
        for slot, cache in enumerate(self.caches):
            cache._slot = slot  # type: ignore[union-attr]

    def dissolve(self, staying: Sequence[Any] = ()) -> None:
        """Every session still adopted takes its rows back: views for the caches in
        ``staying`` (stacked again at once), copies for the others."""
        for cache in self.caches:
            if cache is not None and cache.arena is self:
                cache.detach(copy=all(cache is not c for c in staying))

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               batched: bool, memo: StepArrays | None = None) -> mx.array:
        """Write one position of every row and attend: ``[G * S, H, 1, D]`` in, same out.

        The write index and length of each ring advance on the host exactly
        as ``RotatingKVCache``'s one-position write into a whole ring does (past
        the end, back to the kept sink), for all rows at once. ``memo``: the
        step's write indices and masks, shared by its layers whose rings agree.
        """
        assert self.keys is not None and self.values is not None
        ring, keep = self.ring, self.keep
        positions = [keep if i == ring else i for i in self._idx]  # rotate past the sink
        self._idx = [p + 1 for p in positions]
        self._offset = offsets = [o + 1 for o in self._offset]
        lengths = [o if o < ring else ring for o in offsets]  # RotatingKVCache.size()
        index, mask = step_arrays(tuple(positions), tuple(lengths), self.group,
                                  {} if memo is None else memo)
        self.keys = mx.put_along_axis(self.keys, index, keys, axis=2)
        self.values = mx.put_along_axis(self.values, index, values, axis=2)
        if not batched:
            return self._per_row(queries, scale, lengths)
        longest = max(lengths)
        ring_keys, ring_values = self.keys, self.values
        if longest < ring_keys.shape[2]:
            ring_keys, ring_values = ring_keys[:, :, :longest], ring_values[:, :, :longest]
        return mx.fast.scaled_dot_product_attention(
            queries, ring_keys, ring_values, scale=scale, mask=mask)

    def _per_row(self, queries: mx.array, scale: float, lengths: list[int]) -> mx.array:
        """Each session's core on its own rows (the exact path on any backend)."""
        sessions = self.sessions
        outs = []
        for slot, length in enumerate(lengths):
            k, v = self.row(slot)
            outs.append(mx.fast.scaled_dot_product_attention(
                queries[slot::sessions], k[:, :, :length], v[:, :, :length], scale=scale)[:, None])
        joined = mx.concatenate(outs, axis=1)  # [G, S, ...]: row j of session s -> j * S + s
        return joined.reshape(-1, *joined.shape[2:])


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


class AttentionCores:
    """The attention cores of a stack's layers over the sessions of a step: through the
    sessions' :class:`KVArena` when they allow (two or more sessions, one position,
    whole rings of one size), else each session on its own cache (``alone``).

    Holds only a setting (:attr:`batched`): the arena a step attends through is the
    one its caches name, built from them when they are not yet one arena's rows.
    """

    def __init__(self, batched: bool | None = None) -> None:
        self.batched = batched_by_default() if batched is None else batched

    def __call__(self, queries: mx.array, keys: mx.array, values: mx.array,
                 caches: Sequence[Any], group: int, scale: float,
                 alone: Callable[[], mx.array], memo: StepArrays | None = None) -> mx.array:
        arena = getattr(caches[0], "arena", None)
        # The steady case, every step while the same sessions step: the arena already
        # holds them (adopted rings, of its shape), so only the new rows are checked.
        if arena is None or not arena.holds(caches) or not arena.takes(keys):
            dissolve(caches, staying=caches)
            if not self._fits(caches, keys, group):
                return alone()
            arena = KVArena(caches, group)
        return arena.attend(queries, keys, values, scale, self.batched, memo)

    @staticmethod
    def _fits(caches: Sequence[Any], keys: mx.array, group: int) -> bool:
        if len(caches) < 2 or keys.shape[2] != 1:
            return False
        first = caches[0]
        rows = (group, keys.shape[1], keys.shape[3])
        if not all(isinstance(c, RingCache) and c.keys is not None
                   and c.max_size == first.max_size and c.keep == first.keep
                   and (c.keys.shape[0], c.keys.shape[1], c.keys.shape[3]) == rows
                   and c.keys.dtype == keys.dtype for c in caches):
            return False
        for cache in caches:  # rings still growing are completed for the arena
            cache.complete()
        return True


def ring_offsets(caches: list[Any]) -> tuple[int, ...]:
    """Each cache's ``offset``: the arena's one list when an arena holds them all
    (a copy), else read from each."""
    arena = getattr(caches[0], "arena", None)
    if arena is not None and arena.holds(caches):
        return tuple(arena._offset)
    return tuple(c.offset for c in caches)


def dissolve(caches: Sequence[Any], staying: Sequence[Any] = ()) -> None:
    """Every arena holding any of ``caches`` gives all its rows back (the batch changed):
    views to those in ``staying``, copies to the others."""
    for cache in caches:
        arena = getattr(cache, "arena", None)
        if arena is not None:
            arena.dissolve(staying)
