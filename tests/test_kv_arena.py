"""The KV arena: one write and one attention core per layer for every session of a step.

Each session's ring, stacked in a :class:`KVArena` by its batch, must hold the
same bits and give the same attention as that session's own
``RotatingKVCache`` (the reference's cache class), across the ring's wrap past
its kept sink; the batched core must equal each row's own core; a ring
extracted from the arena continues exactly; and the launches of a layer's step
must not grow with the sessions.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.cache import RotatingKVCache

from mlx_voicechat_plugin.instruments.kernels import KernelCounter
from mlx_voicechat_plugin.models.kv_arena import ArenaAttention, KVArena, RingCache, stack_layer

HEADS, KV_HEADS, DIM = 4, 2, 16


def _pair(max_size: int, keep: int, written: int, group: int, seed: int):
    """A reference ``RotatingKVCache`` and a ``RingCache`` after the same writes."""
    mx.random.seed(seed)
    reference, ring = RotatingKVCache(max_size=max_size, keep=keep), RingCache(max_size, keep)
    for _ in range(written):
        k, v = mx.random.normal((2, group, KV_HEADS, 1, DIM))
        reference.update_and_fetch(k, v)
        ring.update_and_fetch(k, v)
    return reference, ring


def _alone(q: mx.array, cache: RotatingKVCache, k: mx.array, v: mx.array) -> mx.array:
    keys, values = cache.update_and_fetch(k, v)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=DIM**-0.5)


def _not_batched() -> mx.array:
    pytest.fail("not batched")


def _step(arena: KVArena, references, seed: int, group: int = 1, batched: bool = True) -> None:
    """One step of the arena's rows, each checked against its reference cache."""
    mx.random.seed(seed)
    sessions = arena.sessions
    q = mx.random.normal((group * sessions, HEADS, 1, DIM))
    k, v = mx.random.normal((2, group * sessions, KV_HEADS, 1, DIM))
    out = ArenaAttention(batched)(q, k, v, arena, DIM**-0.5, alone=_not_batched)
    for s, reference in enumerate(references):
        rows = slice(s, None, sessions)
        assert mx.array_equal(out[rows], _alone(q[rows], reference, k[rows], v[rows])), (seed, s)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("group", [1, 2])
def test_arena_steps_equal_each_sessions_own_ring_across_the_wrap(batched, group):
    max_size, keep = 12, 3
    written = [1, 5, 11, 12, 20]  # filling, full, wrapped past the sink
    pairs = [_pair(max_size, keep, n, group, seed) for seed, n in enumerate(written)]
    references, rings = [p[0] for p in pairs], [p[1] for p in pairs]
    arena = KVArena.merge(rings, group)
    assert all(r.keys is None for r in rings)  # the arena's rows are the only copy
    for step in range(15):
        _step(arena, references, 100 + step, group, batched)
        assert arena.offsets == [r.offset for r in references]
    for slot, reference in enumerate(references):  # state as the reference's
        ring = arena.extract(slot)
        for a, b in zip(ring.state, reference.state):
            assert mx.array_equal(a, b)
        assert ring.meta_state == reference.meta_state


def test_a_ring_extracted_from_its_arena_continues_exactly_and_stacks_again():
    pairs = [_pair(10, 2, n, 1, seed) for seed, n in enumerate([4, 9, 6])]
    references, rings = [p[0] for p in pairs], [p[1] for p in pairs]
    arena = KVArena.merge(rings, 1)
    for step in range(3):
        _step(arena, references, step)
    first = arena.extract(0)  # the first session leaves; the others stay stacked
    arena.filter([1, 2])
    assert arena.caches == rings[1:] and first.keys is not None
    q = mx.random.normal((1, HEADS, 1, DIM))
    k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM))
    assert mx.array_equal(_alone(q, first, k, v), _alone(q, references[0], k, v))
    _step(arena, references[1:], 10)
    joined = KVArena.merge([arena, first], 1)  # it joins again, appended
    assert joined.caches == [rings[1], rings[2], first]
    _step(joined, [references[1], references[2], references[0]], 11)


def test_a_session_that_leaves_keeps_a_copy_and_the_others_stay_stacked():
    rings = [_pair(8, 0, 8, 2, seed)[1] for seed in range(3)]
    before = [(mx.array(r.keys), mx.array(r.values)) for r in rings]
    arena = KVArena.merge(rings, 2)
    arena.extract(1)
    arena.filter([0, 2])
    assert arena.caches == [rings[0], rings[2]] and rings[0].keys is None
    for slot in range(2):
        arena.extract(slot)
    for ring, (keys, values) in zip(rings, before):
        assert mx.array_equal(ring.keys, keys) and mx.array_equal(ring.values, values)


def test_one_session_or_unequal_rings_do_not_stack():
    one = [_pair(8, 0, 8, 1, 0)[1]]
    unequal = [_pair(8, 0, 8, 1, 0)[1], _pair(9, 0, 9, 1, 1)[1]]
    unwritten = [_pair(300, 0, 1, 1, 0)[1], RingCache(300, 0)]
    plain = [_pair(8, 0, 8, 1, 0)[1], RotatingKVCache(max_size=8)]
    for caches in (one, unequal, unwritten, plain):
        assert not KVArena.fits(caches, 1)
        assert stack_layer(caches, 1) == caches
    called = []
    q = mx.random.normal((2, HEADS, 1, DIM))
    ArenaAttention()(q, q, q, unequal, 1.0, alone=lambda: called.append(1) or q)
    assert called == [1]


def test_a_layer_of_parts_that_do_not_fit_gives_an_arenas_rows_back():
    rings = [_pair(8, 0, 8, 1, seed)[1] for seed in range(2)]
    before = [mx.array(r.keys) for r in rings]
    arena = KVArena.merge(rings, 1)
    other = _pair(9, 0, 9, 1, 2)[1]
    assert stack_layer([arena, other], 1) == [*rings, other]
    assert all(mx.array_equal(r.keys, b) for r, b in zip(rings, before))


def test_the_masked_batched_core_equals_each_rows_core_on_this_backend():
    """What the default relies on: rows shorter than the longest, masked, attend exactly
    as alone (MLX's CPU backend; a GPU's agreement is measured by bench.gpu)."""
    rng = random.Random(1)
    for heads, kv_heads, dim, size, dtype in [(16, 4, 72, 400, mx.float32),
                                              (40, 8, 128, 300, mx.float32),
                                              (8, 4, 64, 200, mx.bfloat16)]:
        sessions, group = rng.randint(2, 6), rng.choice([1, 2])
        lengths = [size] + [rng.randint(1, size) for _ in range(sessions - 1)]
        keys, values = (mx.random.normal((2, group * sessions, kv_heads, size, dim)) * 3).astype(dtype)
        q = mx.random.normal((group * sessions, heads, 1, dim)).astype(dtype)
        mask = mx.array(np.arange(size)[None] < np.array(lengths * group)[:, None])
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=dim**-0.5,
                                                   mask=mask[:, None, None, :])
        for s, length in enumerate(lengths):
            rows = slice(s, None, sessions)
            alone = mx.fast.scaled_dot_product_attention(
                q[rows], keys[rows][:, :, :length], values[rows][:, :, :length], scale=dim**-0.5)
            assert mx.array_equal(out[rows], alone), (heads, dim, dtype, length)


@pytest.mark.parametrize("batched, grows", [(True, False), (False, True)])
def test_a_layers_launches_do_not_grow_with_the_sessions(batched, grows):
    """One scatter per K and V and one core for any number of sessions (batched);
    the exact per-row path still writes once but runs a core per session."""
    def launches(sessions: int) -> int:
        arena = KVArena.merge([_pair(16, 2, 10 + s, 1, s)[1] for s in range(sessions)], 1)
        attention = ArenaAttention(batched)
        q = mx.random.normal((sessions, HEADS, 1, DIM))
        k, v = mx.random.normal((2, sessions, KV_HEADS, 1, DIM))
        mx.eval(q, k, v, arena.keys, arena.values)
        mx.eval(attention(q, k, v, arena, 1.0, alone=_not_batched))
        with KernelCounter() as counter:
            mx.eval(attention(q, k, v, arena, 1.0, alone=_not_batched))
        return counter.kernels

    two, eight = launches(2), launches(8)
    assert (eight > two) == grows, (two, eight)


def test_an_arena_is_built_from_rows_in_the_step_layout():
    rings = [_pair(6, 0, 6, 2, seed)[1] for seed in range(3)]
    rows = [r.keys for r in rings]
    arena = KVArena.merge(rings, group=2)
    for s, row in enumerate(rows):
        assert mx.array_equal(arena.keys[s], row[0]) and mx.array_equal(arena.keys[3 + s], row[1])


def test_the_cores_keep_nothing():
    assert set(vars(ArenaAttention())) == {"batched"}


def test_a_ring_grows_as_it_fills_and_equals_the_reference_cache(monkeypatch):
    """A short conversation holds what it wrote, not the whole ring; the same keys and
    values come back, across its growths and its wrap."""
    monkeypatch.setattr(RingCache, "growth", 4)
    max_size, keep = 10, 2
    reference, ring = RotatingKVCache(max_size=max_size, keep=keep), RingCache(max_size, keep)
    allocated = []
    for step in range(25):
        mx.random.seed(step)
        k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM))
        ours, theirs = ring.update_and_fetch(k, v), reference.update_and_fetch(k, v)
        assert all(mx.array_equal(a, b) for a, b in zip(ours, theirs))
        allocated.append(ring.keys.shape[2])
    assert allocated[:9] == [4, 4, 4, 4, 8, 8, 8, 8, 10] and allocated[-1] == max_size


@pytest.mark.parametrize("batched", [True, False])
def test_growing_rings_are_completed_when_stacked(monkeypatch, batched):
    monkeypatch.setattr(RingCache, "growth", 4)
    max_size, keep = 12, 3
    pairs = [_pair(max_size, keep, n, 1, seed) for seed, n in enumerate([1, 5, 9])]
    assert [p[1].keys.shape[2] for p in pairs] == [4, 8, 12]
    arena = KVArena.merge([p[1] for p in pairs], 1)
    assert arena.keys.shape[2] == max_size
    for step in range(12):
        _step(arena, [p[0] for p in pairs], 200 + step, batched=batched)


def test_a_ring_that_leaves_its_arena_before_it_wraps_takes_back_only_what_it_wrote(
        monkeypatch):
    """A session that pauses early keeps the growth steps it wrote into, not the whole
    ring the arena completed it to, and continues exactly as the reference cache."""
    monkeypatch.setattr(RingCache, "growth", 4)
    max_size, keep = 12, 3
    pairs = [_pair(max_size, keep, n, 1, seed) for seed, n in enumerate([1, 5, 11])]
    references = [p[0] for p in pairs]
    arena = KVArena.merge([p[1] for p in pairs], 1)
    for step in range(2):
        _step(arena, references, 300 + step)
    rings = [arena.extract(s) for s in range(3)]  # they stop stepping together (a pause)
    assert [r.keys.shape[2] for r in rings] == [4, 8, 12]  # 3, 7 written; 13: wrapped
    for step in range(12):  # each alone, across its growths and the wrap
        mx.random.seed(400 + step)
        q = mx.random.normal((1, HEADS, 1, DIM))
        k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM))
        for ring, reference in zip(rings, references):
            assert mx.array_equal(_alone(q, ring, k, v), _alone(q, reference, k, v))
