"""The KV arena: one write and one attention core per layer for every session of a step.

Each session's ring, adopted by a :class:`KVArena`, must hold the same bits
and give the same attention as that session's own ``RotatingKVCache`` (the
reference's cache class), across the ring's wrap past its kept sink; the
batched core must equal each row's own core; a cache taken back from the
arena continues exactly; and the launches of a layer's step must not grow
with the sessions.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.cache import RotatingKVCache

from mlx_voicechat_plugin.models import kv_arena
from mlx_voicechat_plugin.models.kv_arena import AttentionCores, KVArena, RingCache
from mlx_voicechat_plugin.instruments.kernels import KernelCounter

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


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("group", [1, 2])
def test_arena_steps_equal_each_sessions_own_ring_across_the_wrap(batched, group):
    max_size, keep = 12, 3
    written = [1, 5, 11, 12, 20]  # filling, full, wrapped past the sink
    pairs = [_pair(max_size, keep, n, group, seed) for seed, n in enumerate(written)]
    references, rings = [p[0] for p in pairs], [p[1] for p in pairs]
    cores = AttentionCores(batched)
    sessions = len(rings)
    for step in range(15):
        mx.random.seed(100 + step)
        q = mx.random.normal((group * sessions, HEADS, 1, DIM))
        k, v = mx.random.normal((2, group * sessions, KV_HEADS, 1, DIM))
        out = cores(q, k, v, rings, group, DIM**-0.5, alone=lambda: pytest.fail("not batched"))
        for s, reference in enumerate(references):
            rows = slice(s, None, sessions)
            expected = _alone(q[rows], reference, k[rows], v[rows])
            assert mx.array_equal(out[rows], expected), (step, s)
            assert rings[s].offset == reference.offset and rings[s]._idx == reference._idx
    for reference, ring in zip(references, rings):  # state as the reference's
        for a, b in zip(ring.state, reference.state):
            assert mx.array_equal(a, b)
        assert ring.meta_state == reference.meta_state


def test_a_cache_taken_back_from_its_arena_continues_exactly():
    pairs = [_pair(10, 2, n, 1, seed) for seed, n in enumerate([4, 9])]
    cores = AttentionCores()
    rings = [p[1] for p in pairs]
    for step in range(3):
        q = mx.random.normal((2, HEADS, 1, DIM))
        k, v = mx.random.normal((2, 2, KV_HEADS, 1, DIM))
        cores(q, k, v, rings, 1, DIM**-0.5, alone=lambda: pytest.fail("not batched"))
        for s in range(2):
            pairs[s][0].update_and_fetch(k[s : s + 1], v[s : s + 1])
    arena = rings[0].arena
    assert arena is not None and all(r.arena is arena for r in rings)
    # The first session steps alone: it takes its rows back, the other stays adopted.
    q = mx.random.normal((1, HEADS, 1, DIM))
    k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM))
    assert mx.array_equal(_alone(q, rings[0], k, v), _alone(q, pairs[0][0], k, v))
    assert rings[0].arena is None and rings[1].arena is arena
    assert not arena.holds(rings)
    # The next step of both rebuilds the arena from the rows as they are.
    q = mx.random.normal((2, HEADS, 1, DIM))
    k, v = mx.random.normal((2, 2, KV_HEADS, 1, DIM))
    out = cores(q, k, v, rings, 1, DIM**-0.5, alone=lambda: pytest.fail("not batched"))
    for s in range(2):
        assert mx.array_equal(out[s : s + 1], _alone(q[s : s + 1], pairs[s][0], k[s : s + 1],
                                                     v[s : s + 1]))


def test_released_sessions_free_the_arena():
    rings = [_pair(8, 0, 8, 1, seed)[1] for seed in range(3)]
    cores = AttentionCores()
    q = mx.random.normal((3, HEADS, 1, DIM))
    k, v = mx.random.normal((2, 3, KV_HEADS, 1, DIM))
    cores(q, k, v, rings, 1, DIM**-0.5, alone=lambda: pytest.fail("not batched"))
    arena = rings[0].arena
    before = [mx.array(r.keys) for r in rings]
    kv_arena.release(rings[:1])
    assert arena.sessions == 2 and [r.arena for r in rings[1:]] == [arena, arena]
    assert all(mx.array_equal(r.keys, b) for r, b in zip(rings[1:], before[1:]))  # renumbered
    kv_arena.release(rings[1:2])  # the last one takes its rows back as its own
    assert rings[2].arena is None and mx.array_equal(rings[2].keys, before[2])
    assert arena.keys is None and arena.values is None
    assert rings[0].keys is None and rings[1].keys is None  # released: dropped


def test_a_session_that_leaves_with_its_rows_keeps_a_copy_and_the_others_stay_stacked():
    rings = [_pair(8, 0, 8, 2, seed)[1] for seed in range(3)]
    q = mx.random.normal((6, HEADS, 1, DIM))
    k, v = mx.random.normal((2, 6, KV_HEADS, 1, DIM))
    AttentionCores()(q, k, v, rings, 2, DIM**-0.5, alone=lambda: pytest.fail("not batched"))
    arena, before = rings[0].arena, [(mx.array(r.keys), mx.array(r.values)) for r in rings]
    kv_arena.release(rings[1:2], keep=True)
    assert rings[1].arena is None and arena.caches == [rings[0], rings[2]]
    for ring, (keys, values) in zip(rings, before):
        assert mx.array_equal(ring.keys, keys) and mx.array_equal(ring.values, values)


def test_one_session_or_unequal_rings_step_alone():
    called = []
    cores = AttentionCores()
    q = mx.random.normal((2, HEADS, 1, DIM))
    k, v = mx.random.normal((2, 2, KV_HEADS, 1, DIM))
    one = [_pair(8, 0, 8, 1, 0)[1]]
    cores(q[:1], k[:1], v[:1], one, 1, 1.0, alone=lambda: called.append(1) or q[:1])
    unequal = [_pair(8, 0, 8, 1, 0)[1], _pair(9, 0, 9, 1, 1)[1]]
    cores(q, k, v, unequal, 1, 1.0, alone=lambda: called.append(2) or q)
    growing = [_pair(300, 0, 1, 1, 0)[1], RotatingKVCache(max_size=300)]
    cores(q, k, v, growing, 1, 1.0, alone=lambda: called.append(3) or q)
    assert called == [1, 2, 3]
    assert all(getattr(c, "arena", None) is None for c in one + unequal + growing)


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
        rings = [_pair(16, 2, 10 + s, 1, s)[1] for s in range(sessions)]
        cores = AttentionCores(batched)
        q = mx.random.normal((sessions, HEADS, 1, DIM))
        k, v = mx.random.normal((2, sessions, KV_HEADS, 1, DIM))
        mx.eval(q, k, v, *[a for r in rings for a in r.state])
        cores(q, k, v, rings, 1, 1.0, alone=lambda: pytest.fail("not batched"))  # builds it
        mx.eval(rings[0].arena.keys, rings[0].arena.values)
        with KernelCounter() as counter:
            mx.eval(cores(q, k, v, rings, 1, 1.0, alone=lambda: pytest.fail("not batched")))
        return counter.kernels

    two, eight = launches(2), launches(8)
    assert (eight > two) == grows, (two, eight)


def test_an_arena_is_built_from_rows_in_the_step_layout():
    rings = [_pair(6, 0, 6, 2, seed)[1] for seed in range(3)]
    rows = [r.keys for r in rings]
    arena = KVArena(rings, group=2)
    for s, row in enumerate(rows):
        assert mx.array_equal(arena.keys[s], row[0]) and mx.array_equal(arena.keys[3 + s], row[1])
        assert mx.array_equal(rings[s].keys, row)


def test_the_cores_keep_nothing_each_batch_keeps_its_own_arena():
    """Two batches of sessions stepping in turn through one layer's cores each keep their
    arena (it belongs to their rows), and each equals its sessions' own rings."""
    cores = AttentionCores()
    batches = [[_pair(10, 2, n, 1, seed) for seed, n in enumerate(written)]
               for written in ([4, 9], [6, 10, 3])]
    arenas = []
    for step in range(4):
        for pairs in batches:
            rings = [p[1] for p in pairs]
            n = len(rings)
            q = mx.random.normal((n, HEADS, 1, DIM))
            k, v = mx.random.normal((2, n, KV_HEADS, 1, DIM))
            out = cores(q, k, v, rings, 1, DIM**-0.5, alone=lambda: pytest.fail("not batched"))
            for s, (reference, _) in enumerate(pairs):
                expected = _alone(q[s : s + 1], reference, k[s : s + 1], v[s : s + 1])
                assert mx.array_equal(out[s : s + 1], expected), (step, s)
            if step == 0:
                arenas.append(rings[0].arena)
    for pairs, arena in zip(batches, arenas):  # never rebuilt: each batch kept its own
        assert all(p[1].arena is arena for p in pairs)
    assert set(vars(cores)) == {"batched"}


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
def test_growing_rings_are_completed_when_an_arena_adopts_them(monkeypatch, batched):
    monkeypatch.setattr(RingCache, "growth", 4)
    max_size, keep = 12, 3
    pairs = [_pair(max_size, keep, n, 1, seed) for seed, n in enumerate([1, 5, 9])]
    assert [p[1].keys.shape[2] for p in pairs] == [4, 8, 12]
    references, rings = [p[0] for p in pairs], [p[1] for p in pairs]
    cores = AttentionCores(batched)
    for step in range(12):
        mx.random.seed(200 + step)
        q = mx.random.normal((len(rings), HEADS, 1, DIM))
        k, v = mx.random.normal((2, len(rings), KV_HEADS, 1, DIM))
        out = cores(q, k, v, rings, 1, DIM**-0.5, lambda: None)
        for s, reference in enumerate(references):
            expected = _alone(q[s:s + 1], reference, k[s:s + 1], v[s:s + 1])
            assert mx.array_equal(out[s:s + 1], expected)
    assert rings[0].arena is not None and all(r.whole for r in rings)


def test_a_ring_that_leaves_its_arena_before_it_wraps_takes_back_only_what_it_wrote(
        monkeypatch):
    """A session that pauses early keeps the growth steps it wrote into, not the whole
    ring the arena completed it to, and continues exactly as the reference cache."""
    monkeypatch.setattr(RingCache, "growth", 4)
    max_size, keep = 12, 3
    pairs = [_pair(max_size, keep, n, 1, seed) for seed, n in enumerate([1, 5, 11])]
    references, rings = [p[0] for p in pairs], [p[1] for p in pairs]
    cores = AttentionCores()
    for step in range(2):
        mx.random.seed(300 + step)
        q = mx.random.normal((len(rings), HEADS, 1, DIM))
        k, v = mx.random.normal((2, len(rings), KV_HEADS, 1, DIM))
        cores(q, k, v, rings, 1, DIM**-0.5, alone=lambda: pytest.fail("not batched"))
        for s, reference in enumerate(references):
            reference.update_and_fetch(k[s : s + 1], v[s : s + 1])
    assert all(r.arena is not None and r.keys.shape[2] == max_size for r in rings)
    kv_arena.release(rings, keep=True)  # they stop stepping together (a pause)
    assert [r.keys.shape[2] for r in rings] == [4, 8, 12]  # 3, 7 written; 13: wrapped
    for step in range(12):  # each alone, across its growths and the wrap
        mx.random.seed(400 + step)
        q = mx.random.normal((1, HEADS, 1, DIM))
        k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM))
        for ring, reference in zip(rings, references):
            assert mx.array_equal(_alone(q, ring, k, v), _alone(q, reference, k, v))
