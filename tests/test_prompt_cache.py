"""The prompt cache: a repeated system prompt starts from the stored prefill state.

Exactness: a session that starts from the cache produces the same ids and
codes as one that prefilled, for the same and for other seeds; entries are
private copies; the cache is bounded in bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlx_voicechat_plugin.runtime.events import AssistantTextDelta, Audio, FunctionDelta
from mlx_voicechat_plugin.models.cache_state import caches_from_state, cache_meta_state, cache_state
from mlx_voicechat_plugin.runtime.prompt_cache import PromptCache, state_bytes
from mlx_voicechat_plugin.runtime.timeline import Timeline
from mlx_voicechat_plugin.testing.fixtures import question_signal

PROMPT = "You are a helpful assistant. Answer briefly."


@pytest.fixture
def session(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


def _run(stream):
    audio = question_signal(0.6)
    events = []
    for start in range(0, len(audio), 1280):
        events += stream.push_audio(audio[start : start + 1280])
    events += stream.flush()
    return (np.stack([e.audio_codes for e in events if isinstance(e, Audio)]),
            [e.token_id for e in events if isinstance(e, AssistantTextDelta)],
            [e.token_id for e in events if isinstance(e, FunctionDelta)])


def _same(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and a[1:] == b[1:]


def test_a_cached_prompt_gives_the_same_ids_and_codes_as_a_prefill(session):
    first = session.create_streaming_session(system_prompt=PROMPT, seed=5)
    assert not first.prompt_cache_hit
    prefilled = _run(first)
    again = session.create_streaming_session(system_prompt=PROMPT, seed=5)
    assert again.prompt_cache_hit
    assert _same(_run(again), prefilled)
    third = session.create_streaming_session(system_prompt=PROMPT, seed=5)
    assert third.prompt_cache_hit and _same(_run(third), prefilled)  # entries stay pristine


def test_the_seed_is_part_of_the_key(session):
    session.create_streaming_session(system_prompt=PROMPT, seed=1)
    other = session.create_streaming_session(system_prompt=PROMPT, seed=2)
    assert not other.prompt_cache_hit
    session.prompt_cache = PromptCache(0)  # disabled: every session prefills
    fresh = session.create_streaming_session(system_prompt=PROMPT, seed=2)
    assert not fresh.prompt_cache_hit


def test_a_cache_hit_skips_the_prefill(session, monkeypatch):
    session.create_streaming_session(system_prompt=PROMPT)
    calls = []
    monkeypatch.setattr(Timeline, "prefill_steps", lambda self, *a, **k: calls.append(1) or iter(()))
    assert session.create_streaming_session(system_prompt=PROMPT).prompt_cache_hit
    assert not calls


def test_the_cache_is_bounded_in_bytes_and_evicts_the_oldest(session):
    stream = session.create_streaming_session(system_prompt=PROMPT)
    compute = stream.conversation.compute
    state = (compute.state, compute.meta_state)
    size = state_bytes(state)
    cache = PromptCache(max_bytes=2 * size + size // 2)
    for key in ("a", "b", "c"):
        assert cache.put(key, state)
    assert len(cache) == 2 and cache.bytes <= cache.max_bytes
    assert cache.get("a") is None and cache.get("c") is not None
    assert not PromptCache(max_bytes=size - 1).put("x", state)


def test_clones_do_not_share_writes():
    import mlx.core as mx
    from mlx_vlm.models.cache import KVCache

    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))
    stored = PromptCache()
    stored.put("k", (cache_state([cache]), cache_meta_state([cache])))
    clone = caches_from_state(*stored.get("k"))[0]
    clone.keys[..., :1, :] = 1.0
    assert float(cache.keys.sum()) == 0.0 and clone.offset == cache.offset
