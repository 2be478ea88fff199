"""EAR-TTS and codec equal the reference on the fixture checkpoints (bf16 and 4-bit)."""

from __future__ import annotations

import mlx.core as mx

from mlx_voicechat_plugin.runtime.rng import RandomStream


def test_tts_steps_give_identical_codes_for_the_same_seed(loaded_pair):
    (ours, processor), (ref, ref_processor) = loaded_pair
    ref.create_session(ref_processor)  # sets the reference's character vocabulary
    codes, ids, id_mask, audio_mask, latents = ours.tts_model.warmup_inputs(ours.config.pad_token_id)
    ref_prompt = ref.create_session(ref_processor)._tts_prompt()
    assert mx.array_equal(codes, ref_prompt[0])
    _, cache = ours.tts_model.tts_model.warmup(codes, ids, id_mask, audio_mask, latents)
    _, ref_cache = ref.tts_model.tts_model.warmup(*ref_prompt[:-1], audio_prompt_latent=ref_prompt[-1])
    rng = RandomStream(5)
    mx.random.seed(5)
    previous = ref_previous = codes[:, -1:]
    for token in (40, 12, 2, 300):
        text = mx.array([[token]], dtype=mx.int32)
        tts = ours.tts_model.tts_model
        previous = tts.generate_codes(tts.backbone_step(previous, text, [cache]), [rng])
        ref_previous = ref.tts_model.tts_model.step(
            ref_previous, text, mx.ones(text.shape, dtype=mx.bool_), ref_cache
        ).codes
        assert mx.array_equal(previous, ref_previous.astype(mx.int32))


def test_codec_encode_codes_identical_and_decode_within_1e6(loaded_pair, question_audio):
    (ours, _), (ref, _) = loaded_pair
    from mlx_audio.utils import resample_audio

    wave = mx.array(resample_audio(question_audio, 16000, 22050))[None, None, : 1764 * 20]
    codes = ours.tts_model.audio_codec.encode(wave)
    assert mx.array_equal(codes, ref.tts_model.audio_codec.encode(wave).astype(mx.int32))
    decoded = ours.tts_model.audio_codec.decode(codes)
    ref_decoded = ref.tts_model.audio_codec.decode(codes)
    assert float(mx.max(mx.abs(decoded - ref_decoded))) <= 1e-6


def test_tts_backbone_and_mog_weights_held_in_float32(loaded_pair):
    (ours, _), _ = loaded_pair
    tts = ours.tts_model.tts_model
    assert tts.backbone.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    assert tts.mog_head.proj_logits.weight.dtype == mx.float32
    # Norm weights and the bf16 subword path stay as stored.
    assert tts.backbone.layers[0].input_layernorm.weight.dtype == mx.bfloat16
    assert tts.embed_subword.embed_tokens.weight.dtype == mx.bfloat16
