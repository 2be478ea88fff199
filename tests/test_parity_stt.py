"""Speech-to-text networks equal the reference on the same fixture weights.

Covers the bf16 tiny fixture and its 4-bit quantized twin (``parity_ckpt``).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram

from mlx_voicechat_plugin.models.perception.perception import log_mel
from mlx_voicechat_plugin.models.rnnt.rnnt import GreedyRNNT, RNNTState


def _max_abs(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))))


@pytest.fixture(scope="module")
def mel(loaded_pair, question_audio):
    (ours, _), _ = loaded_pair
    return log_mel(question_audio, ours.config.audio_config)


def test_mel_matches_reference_frontend(loaded_pair, question_audio, mel):
    (ours, _), _ = loaded_pair
    reference = log_mel_spectrogram(question_audio, ours.config.audio_config.preprocessor)
    assert mel.shape == reference.shape
    assert _max_abs(mel, reference) <= 1e-5


def test_encoder_and_projection_match(loaded_pair, mel):
    (ours, _), (ref, _) = loaded_pair
    lengths = mx.array([mel.shape[1]], dtype=mx.int32)
    projected, out_lengths, encoded = ours.stt_model.perception(mel, lengths)
    ref_projected, ref_lengths, ref_encoded = ref.stt_model.perception(mel, lengths)
    assert out_lengths.tolist() == ref_lengths.tolist()
    assert _max_abs(encoded, ref_encoded) <= 1e-5
    assert _max_abs(projected, ref_projected) <= 1e-5


def test_encoder_weights_held_in_float32(loaded_pair):
    (ours, _), _ = loaded_pair
    encoder = ours.stt_model.perception.encoder
    assert encoder.layers[0].feed_forward1.linear1.weight.dtype == mx.float32
    # Norm weights stay as stored.
    assert encoder.layers[0].norm_out.weight.dtype == mx.bfloat16


def test_language_heads_match(loaded_pair):
    (ours, _), (ref, _) = loaded_pair
    hidden = ours.config.text_config.hidden_size
    inputs = mx.random.normal((1, 12, hidden), key=mx.random.key(7)) * 0.5
    text, function = ours.stt_model(inputs)
    out = ref.stt_model(inputs)
    assert _max_abs(text, out.text_logits) <= 1e-4
    assert _max_abs(function, out.function_logits) <= 1e-4
    assert mx.array_equal(mx.argmax(text, -1), mx.argmax(out.text_logits, -1))
    assert mx.array_equal(mx.argmax(function, -1), mx.argmax(out.function_logits, -1))


def test_language_cache_steps_match_reference_cache(loaded_pair):
    (ours, _), (ref, _) = loaded_pair
    hidden = ours.config.text_config.hidden_size
    inputs = mx.random.normal((1, 6, hidden), key=mx.random.key(3)) * 0.5
    cache, ref_cache = ours.stt_model.make_cache(), ref.stt_model.make_cache()
    for t in range(inputs.shape[1]):
        text, _ = ours.stt_model(inputs[:, t : t + 1], cache=cache)
        ref_text = ref.stt_model(inputs[:, t : t + 1], cache=ref_cache).text_logits
        assert _max_abs(text, ref_text) <= 1e-4


def test_fused_embedding_is_text_plus_audio_plus_weighted_function(loaded_pair):
    (ours, _), _ = loaded_pair
    stt = ours.stt_model
    audio = mx.ones((1, 1, ours.config.text_config.hidden_size))
    text, function = mx.array([[5]]), mx.array([[7]])
    expected = stt.embed_tokens(text) + audio + 2.0 * stt.embed_tokens(function)
    assert _max_abs(stt.fuse(text, audio, function), expected) == 0.0


def test_rnnt_transcript_matches_reference(loaded_pair, mel):
    (ours, processor), (ref, ref_processor) = loaded_pair
    lengths = mx.array([mel.shape[1]], dtype=mx.int32)
    _, out_lengths, encoded = ours.stt_model.perception(mel, lengths)
    config = ours.config
    stt = ours.stt_model
    greedy = GreedyRNNT(stt.rnnt_decoder, stt.rnnt_joint, config.rnnt_blank_id,
                        config.audio_config.max_symbols)
    state = RNNTState(greedy, list(config.rnnt_vocabulary))
    for t in range(encoded.shape[1]):  # all tries of each frame, as a file is decoded
        symbols = state.advance(encoded[:, t : t + 1])
        mx.eval(symbols, *state.state)
        state.commit(symbols)
    text = state.text
    reference = ref.create_session(ref_processor)._rnnt_decode(encoded, int(out_lengths[0]))
    assert text == reference
    assert text  # the fixture is tuned to emit symbols


def test_quantized_checkpoint_quantizes_only_the_language_model(tiny_q4_ckpt):
    import mlx.nn as nn

    from mlx_voicechat_plugin import load

    model, _ = load(tiny_q4_ckpt)
    quantized = [p for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert "stt_model.lm_head" in quantized and "stt_model.function_head" in quantized
    assert "stt_model.embed_tokens" in quantized
    assert all(p.startswith(("stt_model.llm.", "stt_model.lm_head", "stt_model.function_head",
                             "stt_model.embed_tokens")) for p in quantized)
    assert bool(mx.all(mx.isfinite(model.stt_model.lm_head.scales.astype(mx.float32))))
