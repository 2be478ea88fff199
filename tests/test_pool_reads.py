"""Reading one session's state is a call on the pool that copies that session's rows only.

A close, cancel or flush takes the session's rows out of the pool's batches as
its own (:meth:`StreamPool.extract`); the other sessions stay stacked, so the
frame after it forms nothing and peaks as a steady frame does.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from server_support import FRAME

from mlx_voicechat_plugin.runtime.options import ConversationOptions
from mlx_voicechat_plugin.runtime.pool import StreamPool
from mlx_voicechat_plugin.testing.fixtures import question_signal

KEYS = "abcd"


@pytest.fixture(scope="module")
def voicechat(small_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(small_ckpt)
    return model.create_session(processor)


def _pool(voicechat) -> StreamPool:
    pool = StreamPool(voicechat, max_sessions=len(KEYS))
    for i, k in enumerate(KEYS):
        pool.open(k, ConversationOptions(seed=i))
    return pool


AUDIO = {k: question_signal(1.2, seed=i) for i, k in enumerate(KEYS)}


def _step(pool: StreamPool, keys: str, frame: int) -> int:
    """One frame of ``keys``; MLX's peak bytes during it above the bytes before it."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    chunk = slice(frame * FRAME, (frame + 1) * FRAME)
    assert not pool.step({k: AUDIO[k][chunk] for k in keys}).errors
    return mx.get_peak_memory() - before


@pytest.mark.parametrize("leave", ["close", "cancel", "flush"])
def test_the_frame_after_a_session_leaves_peaks_as_a_steady_frame(voicechat, leave):
    warm = _pool(voicechat)  # the graphs of 4 and 3 rows, traced once
    for frame in range(3):
        _step(warm, KEYS, frame)
    warm.close("a")
    _step(warm, KEYS[1:], 3)
    warm.close_all()
    pool = _pool(voicechat)
    steady = [_step(pool, KEYS, frame) for frame in range(4)][-1]
    leaving = pool.nbytes("a")
    getattr(pool, leave)("a")
    after = _step(pool, KEYS[1:], 4)
    assert after <= steady + leaving, (after, steady, leaving)
    assert pool.batch.members == [pool.get(k).core.compute for k in KEYS[1:]]


def test_a_session_taken_out_rejoins_and_equals_itself_alone(voicechat):
    pool, alone = _pool(voicechat), voicechat.create_streaming_session(
        seed=1)
    events = []
    for frame in range(5):
        if frame == 2:
            pool.extract("b")  # its rows out as its own; the others stay stacked
            assert pool.batch.members == [pool.get(k).core.compute for k in "acd"]
        chunk = slice(frame * FRAME, (frame + 1) * FRAME)
        out = pool.step({k: AUDIO[k][chunk] for k in KEYS})
        assert not out.errors
        events.append([e for e in out.events["b"]])
        assert [type(e) for e in alone.push_audio(AUDIO["b"][chunk])] == [
            type(e) for e in events[-1]]
    pool.extract("b")
    theirs = alone.core.compute.state
    mine = pool.get("b").core.compute.state
    assert len(mine) == len(theirs) and all(
        mx.array_equal(x, y).item() for x, y in zip(mine, theirs))
