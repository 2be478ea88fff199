"""A bounded conversation context: prompt positions (a sink) plus a recent window, in rings.

Until the rings are full a bounded timeline is the unbounded one bit for bit;
past it the rings wrap (many times here, with a window of a few frames), the
prompt's cache entries stay as written, outputs stay finite, state stays
constant, a ``state`` / ``meta_state`` restore mid-wrap continues exactly, and
rows at different wrap points batched in one step equal each row alone.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.models.cache_state import copy_arrays
from mlx_voicechat_plugin.models.language.context import ContextCache, ContextWindow, bound
from mlx_voicechat_plugin.runtime.reservation import ConversationShape, kv_bytes
from mlx_voicechat_plugin.runtime.timeline import Timeline

PROMPT = [5, 9, 3, 7, 11, 2]  # system-prompt token ids: six LLM positions


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def start(tiny_start):
    return tiny_start


def _audio(model, position: int, rows: int = 1) -> mx.array:
    hidden = model.config.text_config.hidden_size
    return mx.random.normal((rows, 1, hidden), key=mx.random.key(100 + position)) * 0.5


def _shape(start, recent: int | None, prompt=PROMPT) -> ConversationShape:
    return ConversationShape(len(prompt), start.positions, recent)


def _timeline(model, start, recent: int | None, seed: int = 0, prompt=PROMPT) -> Timeline:
    timeline = Timeline(model, start, seed=seed, context=_shape(start, recent, prompt).windows())
    for _ in timeline.prefill_steps(list(prompt)):
        pass
    return timeline


def _run(timeline: Timeline, model, first: int, count: int) -> list[tuple]:
    out = []
    for position in range(first, first + count):
        (step,) = timeline.step(_audio(model, position))
        codes = np.array(step.codes)
        out.append((step.index, step.text_id, step.function_id, codes.tobytes()))
    return out


def _copy(timeline: Timeline, model) -> Timeline:
    return Timeline.from_state(model, copy_arrays(timeline.state), timeline.meta_state)


def _nbytes(timeline: Timeline) -> int:
    return sum(a.nbytes for a in timeline.state)


def test_a_ring_before_its_wrap_returns_what_a_growing_cache_does():
    from mlx_vlm.models.cache import KVCache

    window = ContextWindow(keep=3, recent=5)
    grow, ring = KVCache(), ContextCache(window)
    for t in range(window.size):
        k = mx.random.normal((1, 2, 1, 4), key=mx.random.key(t))
        a, b = grow.update_and_fetch(k, -k), ring.update_and_fetch(k, -k)
        assert bool(mx.array_equal(a[0], b[0])) and bool(mx.array_equal(a[1], b[1]))
        assert ring.keys.shape[2] == window.size  # the whole ring from the first write
    # A cache of the prompt continues as a ring over the same rows.
    continued = bound(grow, ContextWindow(keep=window.size, recent=2))
    assert continued.offset == window.size and bool(mx.array_equal(continued.keys, grow.keys[..., :8, :]))


def test_bounded_equals_unbounded_until_the_window_is_full(model, start):
    recent = 25  # two seconds
    bounded = _timeline(model, start, recent)
    unbounded = _timeline(model, start, None)
    # R frames fill the rings (the prompt plus R positions); the next one evicts.
    assert _run(bounded, model, 0, recent) == _run(unbounded, model, 0, recent)
    kinds = [type(c) for c in bounded.language[0].cache if hasattr(c, "keys")]
    assert kinds and all(k is ContextCache for k in kinds)


def test_a_tiny_window_wraps_many_times_keeping_the_prompt(model, start):
    recent = 5  # 0.4 s: the rings wrap every five frames
    timeline = _timeline(model, start, recent)
    language = [c for c in timeline.language[0].cache if isinstance(c, ContextCache)]
    speech = [c for c in timeline.tts_caches[0] if isinstance(c, ContextCache)]
    assert language and speech
    first = _run(timeline, model, 0, 1)  # the rings are allocated whole now
    sinks = [(c, c.keep, mx.array(c.keys[..., : c.keep, :]), mx.array(c.values[..., : c.keep, :]))
             for c in language + speech]
    assert all(keep > 0 for _, keep, _, _ in sinks)
    full = None
    for position in range(1, 12 * recent):
        (step,) = timeline.step(_audio(model, position))
        assert np.all(np.array(step.codes) >= 0)
        if position == 2 * recent:
            full = _nbytes(timeline)
    assert first and full is not None and _nbytes(timeline) == full
    for cache, keep, keys, values in sinks:
        assert cache.offset > cache.max_size + 5 * recent  # wrapped many times
        assert cache.keys.shape[2] == cache.max_size  # read whole: the sink is attended
        assert bool(mx.array_equal(cache.keys[..., :keep, :], keys))
        assert bool(mx.array_equal(cache.values[..., :keep, :], values))
    shape = _shape(start, recent)
    llm_tts = sum(c.nbytes for c in language + speech)
    assert llm_tts <= kv_bytes(model.config, shape, None)


def test_a_restore_mid_wrap_continues_exactly(model, start):
    recent = 4
    timeline = _timeline(model, start, recent, seed=2)
    _run(timeline, model, 0, 3 * recent + 1)  # mid-ring, wrapped three times
    twin = _copy(timeline, model)
    assert twin.meta_state == timeline.meta_state
    assert _run(twin, model, 13, 2 * recent + 3) == _run(timeline, model, 13, 2 * recent + 3)


def test_rows_at_different_wrap_points_batch_as_each_alone(model, start):
    rows = [_timeline(model, start, recent, seed=s)
            for s, recent in ((0, 3), (1, 5), (2, None))]
    for b, row in enumerate(rows):
        _run(row, model, 0, 4 + 3 * b)  # different positions, ring phases and sizes
    alone = [_copy(row, model) for row in rows]
    for position in range(6):
        merged = Timeline.merge(rows)
        audio = mx.concatenate([_audio(model, 10 * b + position) for b in range(len(rows))])
        steps = merged.step(audio)
        rows = [merged.remove(b) for b in reversed(range(len(rows)))][::-1]
        for b, (step, twin) in enumerate(zip(steps, alone)):
            (want,) = twin.step(_audio(model, 10 * b + position))
            assert (step.text_id, step.function_id) == (want.text_id, want.function_id)
            assert bool(mx.array_equal(step.codes, want.codes))


def test_the_computed_growth_is_the_measured_one(model, start):
    """The reservation's bytes per frame (from the config) against a session's caches."""
    timeline = _timeline(model, start, None, prompt=[])
    before = _nbytes(timeline)
    _run(timeline, model, 0, 2)
    mid = _nbytes(timeline)
    _run(timeline, model, 2, 3)
    shape = _shape(start, None, prompt=[])
    assert _nbytes(timeline) - mid == kv_bytes(model.config, shape, 5) - kv_bytes(model.config, shape, 2)
    assert before > 0


def test_the_unbounded_path_is_the_references_and_the_default_equals_it_within_its_window(
        loaded_pair, question_audio):
    """``context_seconds=0`` is the reference's growing caches, bit for bit (frame 0's
    codes aside, conformance divergence 1); the default 120 s window gives the same
    bits on a clip far shorter than it."""
    (model, processor), (ref, ref_processor) = loaded_pair
    turn = dict(system_prompt="You are brief.", seed=1)
    unbounded = model.create_session(processor).generate(
        question_audio, extra_decoding_seconds=0.0, context_seconds=0, **turn)
    default = model.create_session(processor).generate(
        question_audio, extra_decoding_seconds=0.0, **turn)
    theirs = ref.create_session(ref_processor).generate(question_audio, use_language_cache=True,
                                                        **turn)
    assert np.array_equal(unbounded.text_tokens, np.array(theirs.text_tokens))
    assert np.array_equal(unbounded.function_tokens, np.array(theirs.function_tokens))
    assert np.array_equal(unbounded.audio_codes[1:], np.array(theirs.audio_codes)[1:])
    for field in ("text_tokens", "function_tokens", "audio_codes", "audio"):
        assert getattr(default, field).tobytes() == getattr(unbounded, field).tobytes()
