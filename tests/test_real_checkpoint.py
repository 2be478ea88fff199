"""A real checkpoint end to end: load, offline, streaming with profile, one server session.

Runs only when ``MLX_VOICECHAT_CHECKPOINT`` names a checkpoint directory (or a
cached hub id), e.g. the released NemotronLabs-VoiceChat-11B-4bit::

    MLX_VOICECHAT_CHECKPOINT=/path/to/NemotronLabs-VoiceChat-11B-4bit make test-real

Nothing here downloads weights. On a real checkpoint the answer's content is
not known in advance, so these tests check structure and the audio rule, and
that streaming agrees with offline on the frames both produce.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mlx_voicechat_plugin.runtime.events import Audio, Done
from mlx_voicechat_plugin.testing.fixtures import question_signal

ENV = "MLX_VOICECHAT_CHECKPOINT"
CHECKPOINT = os.environ.get(ENV)
SECONDS = 2.0

pytestmark = [
    pytest.mark.real_checkpoint,
    pytest.mark.skipif(not CHECKPOINT, reason=f"{ENV} is not set (see `make test-real`)"),
]


@pytest.fixture(scope="module")
def loaded():
    from mlx_voicechat_plugin import load

    return load(CHECKPOINT)


@pytest.fixture(scope="module")
def session(loaded):
    model, processor = loaded
    return model.create_session(processor)


def test_load_gives_a_voicechat_model(loaded):
    model, processor = loaded
    assert model.config.model_type == "nemotron_voicechat"
    assert hasattr(processor, "encode") or hasattr(processor, "tokenizer")


def test_offline_generate_two_seconds(session):
    config = session.model.config
    result = session.generate(question_signal(SECONDS), extra_decoding_seconds=1.0, seed=0)
    frames = result.text_tokens.shape[0]
    assert frames > 0 and result.function_tokens.shape == (frames,)
    assert result.audio_codes.shape == (frames, config.codec_config.num_quantizers)
    assert result.audio.shape == (frames * session.model.tts_model.audio_codec.samples_per_frame,)
    assert np.isfinite(result.audio).all()


def test_streaming_two_seconds_with_profile(session):
    config = session.model.config
    stream = session.create_streaming_session(seed=0, profile=True)
    audio = question_signal(SECONDS)
    events = []
    for start in range(0, len(audio), config.frame_samples):
        events += stream.push_audio(audio[start : start + config.frame_samples])
    events += stream.flush()
    assert isinstance(events[-1], Done)
    frames = [e for e in events if isinstance(e, Audio)]
    assert [e.frame_index for e in frames] == list(range(len(frames)))
    assert all(e.samples.shape == (session.model.tts_model.audio_codec.samples_per_frame,)
               for e in frames)
    summary = stream.profile().summary(drop_first=min(5, len(frames) - 1))
    print(json.dumps(summary, indent=1))
    assert summary["frames"] > 0 and summary["host_syncs"] >= 2


def test_one_server_session(loaded):
    from conformance.wire import our_events, script

    messages = script(question_signal(SECONDS), CHECKPOINT, system_prompt=None, seed=0,
                      chunk=4000, cancel=False)
    events = our_events(CHECKPOINT, messages)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "session.created" and "session.updated" in kinds
    assert "input_audio_buffer.committed" in kinds and kinds[-1] == "response.done"
    audio = [e for e in events if e["type"] == "response.audio.delta"]
    assert audio and [e["frame_index"] for e in audio] == list(range(len(audio)))


def test_the_checkpoint_converts_to_lean_and_compares(tmp_path):
    """``convert`` to the lean profile writes what it planned and loads; ``compare``
    reports every stage of it against the checkpoint (real numbers, no bounds:
    docs/checkpoints.md says what they mean)."""
    from mlx_voicechat_plugin.cli.compare import FLOAT_STAGES, ID_STAGES, compare_checkpoints
    from mlx_voicechat_plugin.conversion.convert import convert
    from mlx_voicechat_plugin.testing.fixtures import make_question_wav

    done = convert(CHECKPOINT, tmp_path / "lean", "lean", progress=False)
    assert done.written == done.plan.part_bytes()
    question = make_question_wav(tmp_path / "q.wav", SECONDS)
    report = compare_checkpoints(CHECKPOINT, done.out, question, extra_decoding_seconds=1.0)
    assert [s.stage for s in report.floats] == list(FLOAT_STAGES)
    assert [s.stage for s in report.ids] == list(ID_STAGES)
    assert report.a.user_transcript and report.b.answer_heard is not None
    print(report.text())
