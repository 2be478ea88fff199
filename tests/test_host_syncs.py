"""Host syncs are counted, not declared: a steady frame waits for MLX exactly twice.

One evaluation covers the encoder step and the token ids (the TTS spells the
text token on the host), the other the RNNT frame, the TTS codes and the codec
samples. While the encoder's windows fill (the first frames), ``mx.compile``
traces each new window width and mlx-audio's subsampling reads its length
constant once more; that is the only extra read.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.instruments.syncs import HostSyncCounter
from mlx_voicechat_plugin.testing.fixtures import question_signal

WARMUP_FRAMES = 6  # the tiny encoder's windows are full by then


@pytest.fixture(scope="module")
def session(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


def _profiled_frames(session, seconds=1.0):
    stream = session.create_streaming_session(profile=True)
    audio = question_signal(seconds)
    for start in range(0, len(audio), 1280):
        stream.push_audio(audio[start : start + 1280])
    stream.flush()
    return stream.profile().frames


def test_a_steady_frame_makes_two_host_syncs(session):
    frames = _profiled_frames(session)
    steady = frames[WARMUP_FRAMES:]
    assert steady and all(f.sync_calls == ["eval", "eval"] for f in steady), \
        [f.sync_calls for f in steady]
    assert all(f.host_syncs == 2 for f in steady)
    for frame in frames[:WARMUP_FRAMES]:
        assert frame.sync_calls.count("eval") == 2
        assert set(frame.sync_calls) <= {"eval", "__int__"}


def test_an_added_item_inside_the_frame_is_counted(session, monkeypatch):
    from mlx_voicechat_plugin.runtime.timeline import Timeline

    speak = Timeline.speak

    def speak_and_read(timeline, tokens, clock):
        tokens.text[0].item()  # a read-back the frame does not need
        return speak(timeline, tokens, clock)

    monkeypatch.setattr(Timeline, "speak", speak_and_read)
    steady = _profiled_frames(session, 0.6)[WARMUP_FRAMES:]
    assert steady and all(f.host_syncs == 3 and "item" in f.sync_calls for f in steady)


def test_counter_counts_waits_not_reads_of_evaluated_arrays():
    a = mx.arange(4) * 2
    with HostSyncCounter() as counter:
        b = a + 1
        mx.eval(b)
        b.tolist()  # already evaluated by this window's eval
        np.array(b)
        (a * 3).sum().item()
        np.asarray(a + 2)
        float((a + 1).max())
    assert counter.calls == ["eval", "item", "np.asarray", "__float__"]
    assert counter.count == 4 and counter.wait_ms >= 0


def test_counter_ignores_other_threads_and_restores_mlx():
    original_eval, original_item = mx.eval, mx.array.item
    with HostSyncCounter() as counter:
        worker = threading.Thread(target=lambda: (mx.arange(3) + 1).tolist())
        worker.start()
        worker.join()
        with pytest.raises(RuntimeError, match="already active"):
            HostSyncCounter().__enter__()
    assert counter.count == 0
    assert mx.eval is original_eval and mx.array.item is original_item
