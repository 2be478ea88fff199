"""Offline generation equals the reference ``session.generate`` (see conformance/README.md)."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.diff import run_pair

SYSTEM_PROMPT = "You are a helpful assistant."


@pytest.fixture(scope="module")
def offline_ckpt(request, tiny_ckpt, tiny_q4_ckpt, small_ckpt):
    return {"tiny": tiny_ckpt, "tiny-q4": tiny_q4_ckpt, "small": small_ckpt}[request.param]


def _loaded(path):
    from mlx_vlm.utils import load as reference_load

    from mlx_voicechat_plugin import load

    return load(path), reference_load(str(path))


_PAIRS: dict = {}


def loaded(path):
    if path not in _PAIRS:
        _PAIRS.clear()  # keep one checkpoint pair in memory at a time
        _PAIRS[path] = _loaded(path)
    return _PAIRS[path]


CASES = [
    ("tiny", None, 0),
    ("tiny", None, 1),
    ("tiny", SYSTEM_PROMPT, 0),
    ("tiny", SYSTEM_PROMPT, 1),
    ("tiny-q4", None, 0),
    ("tiny-q4", None, 1),
    ("tiny-q4", SYSTEM_PROMPT, 0),
    ("tiny-q4", SYSTEM_PROMPT, 1),
    ("small", None, 0),
    ("small", None, 1),
    ("small", SYSTEM_PROMPT, 0),
    ("small", SYSTEM_PROMPT, 1),
]


@pytest.mark.parametrize(
    "offline_ckpt,system_prompt,seed",
    CASES,
    indirect=["offline_ckpt"],
    ids=[f"{c}-{'prompt' if p else 'noprompt'}-seed{s}" for c, p, s in CASES],
)
def test_every_stage_matches_reference(offline_ckpt, question_audio, system_prompt, seed):
    diffs = run_pair(
        offline_ckpt, question_audio, system_prompt=system_prompt, seed=seed,
        extra_decoding_seconds=1.0, reference_language_cache=True,
        loaded=loaded(offline_ckpt),
    )
    failed = {d.stage: d.row() for d in diffs if not d.ok}
    assert not failed, failed


def test_reference_default_recompute_gives_same_ids(tiny_ckpt, question_audio):
    diffs = run_pair(tiny_ckpt, question_audio, extra_decoding_seconds=0.5,
                     reference_language_cache=False, loaded=loaded(tiny_ckpt))
    assert all(d.ok for d in diffs), [d.row() for d in diffs if not d.ok]


def test_cached_and_recompute_modes_agree(tiny_ckpt, question_audio):
    (model, processor), _ = loaded(tiny_ckpt)
    session = model.create_session(processor)
    cached = session.generate(question_audio, extra_decoding_seconds=0.5, use_language_cache=True)
    full = session.generate(question_audio, extra_decoding_seconds=0.5, use_language_cache=False)
    assert np.array_equal(cached.text_tokens, full.text_tokens)
    assert np.array_equal(cached.function_tokens, full.function_tokens)
    assert np.array_equal(cached.audio_codes, full.audio_codes)


def test_same_seed_gives_byte_identical_output(tiny_ckpt, question_audio):
    (model, processor), _ = loaded(tiny_ckpt)
    session = model.create_session(processor)
    a = session.generate(question_audio, extra_decoding_seconds=0.5, seed=3)
    b = session.generate(question_audio, extra_decoding_seconds=0.5, seed=3)
    assert a.audio.tobytes() == b.audio.tobytes()
    assert a.audio_codes.tobytes() == b.audio_codes.tobytes()
    assert a.text == b.text and a.user_transcript == b.user_transcript


def test_reference_position_zero_divergence(tiny_ckpt, question_audio):
    """Divergence 1: the reference leaves offline frame 0 at code 0; we emit silence."""
    (model, processor), (ref, ref_processor) = loaded(tiny_ckpt)
    ours = model.create_session(processor).generate(question_audio, extra_decoding_seconds=0.0)
    theirs = ref.create_session(ref_processor).generate(question_audio, use_language_cache=True)
    silence = np.array(model.tts_model.codec_silence_tokens)
    assert np.array_equal(ours.audio_codes[0], silence)
    assert not np.array_equal(np.array(theirs.audio_codes[0]), silence)
    assert np.array_equal(ours.audio_codes[1:], np.array(theirs.audio_codes)[1:])


def test_result_fields(tiny_ckpt, question_audio):
    (model, processor), _ = loaded(tiny_ckpt)
    result = model.create_session(processor).generate(question_audio, extra_decoding_seconds=0.5)
    frames = len(result.text_tokens)
    assert result.sample_rate == 22050
    assert result.audio.dtype == np.float32
    assert result.audio.shape == (frames * 1764,)
    assert result.audio_codes.shape == (frames, 31)
    assert np.isfinite(result.audio).all()
    assert isinstance(result.function_text, str)


def test_limits_are_enforced_with_clear_errors(tiny_ckpt):
    (model, processor), _ = loaded(tiny_ckpt)
    session = model.create_session(processor)
    with pytest.raises(ValueError, match="extra_decoding_seconds"):
        session.generate(np.zeros(1600, np.float32), extra_decoding_seconds=601)
    with pytest.raises(ValueError, match="at most 1200 s"):
        session.generate(np.zeros(16000 * 1201, np.float32))


def test_any_rate_and_channel_count_is_resampled_to_16k_mono(tiny_ckpt, tmp_path):
    import wave

    from mlx_voicechat_plugin.testing.fixtures import question_signal

    stereo = np.repeat(question_signal(1.0, sample_rate=22050)[:, None], 2, axis=1)
    path = tmp_path / "stereo22k.wav"
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(2)
        handle.setsampwidth(2)
        handle.setframerate(22050)
        handle.writeframes((stereo * 32767).astype("<i2").tobytes())
    (model, processor), _ = loaded(tiny_ckpt)
    session = model.create_session(processor)
    result = session.generate(path, extra_decoding_seconds=0.0)
    native = session.generate(question_signal(1.0), extra_decoding_seconds=0.0)
    assert len(result.text_tokens) == len(native.text_tokens)  # 1 s of 16 kHz mono


def test_streaming_entry_point_of_the_model_s_runtime(tiny_ckpt):
    from mlx_voicechat_plugin.runtime.options import ConversationOptions

    (model, processor), _ = loaded(tiny_ckpt)
    stream = model.create_session(processor).create_streaming_session(ConversationOptions(seed=2))
    assert stream.options.seed == 2 and not stream.closed
