"""The audio rule (``runtime/events.py``): one complete ``Audio`` per frame.

Each frame's event carries its codes and exactly ``samples_per_frame`` samples;
``frame_index`` runs 0, 1, 2, ... ; joined, the samples equal the offline
decode of the same codes sample for sample, the codec's held tail included,
whatever the chunk size and whether the partial frame is padded or dropped.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.runtime.events import Audio, AudioFrames, Cancelled, Done
from mlx_voicechat_plugin.testing.fixtures import question_signal

# 12.5 frames: the last frame is partial, so pad_partial decides the count.
SIGNAL = np.concatenate([question_signal(0.5), np.zeros(8000, np.float32)])


@pytest.fixture(scope="module")
def session(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


def _run(session, chunk: int, pad_partial: bool):
    stream = session.create_streaming_session(seed=0)
    events = []
    for start in range(0, len(SIGNAL), chunk):
        events += stream.push_audio(SIGNAL[start : start + chunk])
    return events + stream.flush(pad_partial=pad_partial)


@pytest.mark.parametrize("pad_partial", [True, False], ids=["padded", "dropped"])
@pytest.mark.parametrize("chunk", [1, 320, 1280, 4000])
def test_one_complete_audio_event_per_frame(session, chunk, pad_partial):
    config = session.model.config
    codec = session.model.tts_model.audio_codec
    events = _run(session, chunk, pad_partial)
    audio = [e for e in events if isinstance(e, Audio)]
    frames = len(SIGNAL) // config.frame_samples + (1 if pad_partial else 0)
    assert [e.frame_index for e in audio] == list(range(frames))
    assert isinstance(events[-1], Done) and events[-1].frame_index == frames
    for event in audio:
        assert event.audio_codes.shape == (config.codec_config.num_quantizers,)
        assert event.samples.shape == (codec.samples_per_frame,)
        assert event.sample_rate == config.output_sample_rate
    codes = np.stack([e.audio_codes for e in audio])  # (T, Q)
    offline = np.array(codec.decode(mx.array(codes.T[None]))[0, 0])
    assert np.array_equal(np.concatenate([e.samples for e in audio]), offline)


def test_each_frame_audio_follows_its_text_and_precedes_the_next_frame(session):
    events = _run(session, 1280, True)
    for before, event in zip(events, events[1:]):
        # Events never go back in frame order; a frame's Audio is its last event.
        assert before.frame_index <= event.frame_index or isinstance(event, Done)
        if isinstance(before, Audio) and not isinstance(event, Done):
            assert event.frame_index == before.frame_index + 1


def test_cancel_completes_the_last_frame_audio(session):
    stream = session.create_streaming_session()
    stream.push_audio(SIGNAL[:3000])  # two frames run
    events = stream.cancel()
    assert [type(e) for e in events] == [Audio, Cancelled]
    assert events[0].frame_index == 1 and events[0].samples.shape == (1764,)


def test_audio_frames_rejects_a_short_frame():
    frames = AudioFrames(samples_per_frame=8, sample_rate=100)
    assert frames.push(0, np.zeros(2, np.int32), np.ones(6, np.float32)) is None
    done = frames.push(1, np.zeros(2, np.int32), np.ones(8, np.float32))
    assert done.frame_index == 0 and done.samples.shape == (8,)
    with pytest.raises(RuntimeError, match="frame 1 has 7 samples, expected 8"):
        frames.finish(np.ones(1, np.float32))
    assert AudioFrames(8, 100).finish(np.ones(2, np.float32)) is None
