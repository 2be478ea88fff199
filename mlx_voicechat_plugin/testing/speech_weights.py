"""Synthetic weights of the speech side: EAR-TTS (backbone, character encoder, MoG head,
subword buffers) and the audio codec, in the converted on-disk layout (:mod:`.weights`)."""

from __future__ import annotations

import math
from typing import Mapping

import mlx.core as mx
import numpy as np

from ..config import CodecConfig, ModelConfig, TTSConfig
from .tensors import Tensors, Tuning
from .tokenizers import WORD_START_MARKER

CONTROL_CODE_COUNT = 3


def _gemma_attention(t: Tensors, p: str, hidden: int, heads: int, kv_heads: int,
                     head_dim: int) -> None:
    t.linear(f"{p}.q_proj", heads * head_dim, hidden)
    t.linear(f"{p}.k_proj", kv_heads * head_dim, hidden)
    t.linear(f"{p}.v_proj", kv_heads * head_dim, hidden)
    t.linear(f"{p}.o_proj", hidden, heads * head_dim)


def _gated_mlp(t: Tensors, p: str, hidden: int, inner: int) -> None:
    t.linear(f"{p}.gate_proj", inner, hidden)
    t.linear(f"{p}.up_proj", inner, hidden)
    t.linear(f"{p}.down_proj", hidden, inner)


def tts_weights(t: Tensors, config: ModelConfig, vocab: Mapping[str, int]) -> None:
    tts: TTSConfig = config.tts_config
    hidden, inner = tts.hidden_size, tts.intermediate_size
    p = "tts_model.tts_model"
    for idx in range(tts.num_hidden_layers):
        q = f"{p}.backbone.layers.{idx}"
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            t.norm(f"{q}.{norm}", hidden, offset=True)
        _gemma_attention(t, f"{q}.self_attn", hidden, tts.num_attention_heads,
                         tts.num_key_value_heads, tts.head_dim)
        t.norm(f"{q}.self_attn.q_norm", tts.head_dim, offset=True)
        t.norm(f"{q}.self_attn.k_norm", tts.head_dim, offset=True)
        _gated_mlp(t, f"{q}.mlp", hidden, inner)
    t.norm(f"{p}.backbone.norm", hidden, offset=True)
    t.normal(f"{p}.bos_emb", (hidden,), 1.0)
    t.normal(f"{p}.null_emb", (hidden,), 1.0)
    t.linear(f"{p}.embed_code", hidden, tts.latent_size)
    t.normal(f"{p}.audio_prompt_projection_W", (hidden, hidden), 1.0 / math.sqrt(hidden))

    char = tts.character_encoder
    c = f"{p}.embed_subword"
    for idx in range(char.num_hidden_layers):
        q = f"{c}.backbone.encoder.layers.{idx}"
        _gemma_attention(t, f"{q}.self_attn", char.hidden_size, char.num_attention_heads,
                         char.num_key_value_heads, char.head_dim)
        for norm in ("pre_self_attn_layernorm", "post_self_attn_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            t.norm(f"{q}.{norm}", char.hidden_size, offset=True)
        _gated_mlp(t, f"{q}.mlp", char.hidden_size, char.intermediate_size)
    t.norm(f"{c}.backbone.encoder.norm", char.hidden_size, offset=True)
    t.normal(f"{c}.embed_tokens.weight", (char.char_vocab_size, char.hidden_size),
             1.0 / math.sqrt(char.hidden_size))
    t.linear(f"{c}.proj_embedding", hidden, char.hidden_size)
    t.normal(f"{c}.subword_flag_emb.cont_emb.weight", (2, char.hidden_size), 0.1)
    t.normal(f"{c}.bos_eos_emb.special_emb.weight", (3, char.hidden_size), 0.1)
    _subword_buffers(t, c, char.subword_vocab_size, config, vocab)

    g = f"{p}.gated_fusion_audio_text"
    t.linear(f"{g}.audio_proj", hidden, hidden, bias=True)
    t.linear(f"{g}.text_proj", hidden, hidden, bias=True)
    t.normal(f"{g}.gate", (hidden,), 0.5)
    t.put(f"{g}.residual_scale", np.array(0.0, np.float32))
    t.norm(f"{g}.final_norm", hidden, offset=True)

    mog = tts.mog_head
    h = f"{p}.mog_head"
    for idx in range(mog.num_layers):
        t.norm(f"{h}.mlp_stack.{idx}.pre_norm", hidden, offset=True)
        _gated_mlp(t, f"{h}.mlp_stack.{idx}.mlp", hidden, mog.intermediate_size)
        t.norm(f"{h}.mlp_stack.{idx}.post_norm", hidden, offset=True)
    t.norm(f"{h}.mlp_stack.{mog.num_layers}", hidden, offset=True)
    t.linear(f"{h}.proj_logits", mog.num_predictions, hidden)
    t.linear(f"{h}.proj_mus", mog.num_predictions * mog.low_rank, hidden)
    t.linear(f"{h}.proj_logs", 1, hidden, gain=0.1)
    t.linear(f"{h}.proj_else", tts.latent_size, hidden)
    t.normal(f"{h}.low_mat", (mog.num_predictions, tts.latent_size, mog.low_rank),
             1.0 / math.sqrt(mog.low_rank))

    t.normal("tts_model.audio_prompt_latents.Aria", (1, tts.prompt_frames, hidden), 1.0)
    rng = t.rng("tts_model.codes")
    control = rng.choice(tts.codebook_size, CONTROL_CODE_COUNT, replace=False)
    t.put("tts_model._control_codes", control.astype(np.int64), mx.int64)
    silence = rng.integers(0, tts.codebook_size, tts.num_quantizers)
    t.put("tts_model.codec_silence_tokens", silence.astype(np.int64), mx.int64)


def _subword_buffers(t: Tensors, p: str, table_size: int, config: ModelConfig,
                     vocab: Mapping[str, int]) -> None:
    """Continuation / BOS-EOS flag tables of the char-aware subword encoder."""
    continuation = np.zeros(table_size + 1, np.int64)
    for token, idx in vocab.items():
        continuation[idx] = 0 if token.startswith(WORD_START_MARKER) else 1
    t.put(f"{p}.subword_flag_emb.is_continuation", continuation, mx.int64)
    t.put(f"{p}.subword_flag_emb.pad_tensor", np.array(table_size, np.int64), mx.int64)
    flags = np.zeros(table_size, np.int64)
    flags[config.bos_token_id] = 1
    flags[config.eos_token_id] = 2
    t.put(f"{p}.bos_eos_emb.special_flags", flags, mx.int64)
    t.put(f"{p}.bos_eos_emb.pad_tensor", np.array(table_size - 1, np.int64), mx.int64)


def _convnext(t: Tensors, p: str, channels: int, kernel: int, out_bias: bool = True) -> None:
    """One ConvNeXt block; ``out_bias=False`` leaves its ``pwconv2`` bias to the caller."""
    t.conv(f"{p}.dwconv", (channels, 1, kernel), bias=True)
    t.norm(f"{p}.norm", channels, bias=True)
    t.conv(f"{p}.pwconv1", (4 * channels, channels, 1), bias=True)
    t.conv(f"{p}.pwconv2", (channels, 4 * channels, 1), bias=out_bias)


def _quiet_output_conv(t: Tensors, bias_key: str, weight_key: str, codec: CodecConfig,
                       log_magnitude: float) -> None:
    """Final decoder conv whose magnitude logits sit near ``log_magnitude``.

    The last ConvNeXt block adds a constant ``offset`` to its output (its
    ``pwconv2`` bias); the magnitude rows of the 1x1 output conv read it back as
    a constant logit, so the decoded spectrum, and the waveform, stay quiet.
    """
    width = codec.stage_channels[0]
    offset = t.rng(bias_key).standard_normal(width).astype(np.float32)
    offset *= 4.0 / np.linalg.norm(offset) * math.sqrt(width)
    t.put(bias_key, offset)
    unit = offset / np.linalg.norm(offset)
    rows = t.rng(weight_key).standard_normal((2 * codec.stft_bins, width)) / math.sqrt(width)
    rows -= np.outer(rows @ unit, unit)
    rows[: codec.stft_bins] += log_magnitude * offset / float(offset @ offset)
    t.put(weight_key, rows[..., None].astype(np.float32))


def codec_weights(t: Tensors, codec: CodecConfig, tuning: Tuning) -> None:
    channels = codec.stage_channels
    stft_channels = 2 * codec.stft_bins
    enc, dec = "tts_model.audio_codec.encoder.layers", "tts_model.audio_codec.decoder.layers"
    t.conv(f"{enc}.0", (channels[0], stft_channels, 1))
    idx = 1
    for stage, (width, rate) in enumerate(zip(channels, codec.downsample_rates)):
        for _ in range(codec.blocks_per_stage):
            _convnext(t, f"{enc}.{idx}", width, codec.block_kernel_size)
            idx += 1
        nxt = channels[stage + 1] if stage + 1 < len(channels) else codec.latent_dim
        t.conv(f"{enc}.{idx}", (nxt, width, rate))
        idx += 1
    idx, source = 0, codec.latent_dim
    stages = list(zip(reversed(channels), reversed(codec.downsample_rates)))
    for stage, (width, rate) in enumerate(stages):
        # ConvTranspose1d weights are [in, out, kernel] in PyTorch.
        t.conv(f"{dec}.{idx}", (source, width, rate), fan_in=source)
        idx += 1
        for block in range(codec.blocks_per_stage):
            # The very last block's output bias is _quiet_output_conv's.
            last = stage == len(stages) - 1 and block == codec.blocks_per_stage - 1
            _convnext(t, f"{dec}.{idx}", width, codec.block_kernel_size, out_bias=not last)
            idx += 1
        source = width
    _quiet_output_conv(t, f"{dec}.{idx - 1}.pwconv2.bias", f"{dec}.{idx}.weight",
                       codec, tuning.codec_log_magnitude)

    # Residual codebooks shrink level by level; EAR-TTS shares them (rvq_embs).
    levels = []
    for level in range(codec.num_quantizers):
        key = f"tts_model.audio_codec.prvq.mus_list.{level}"
        scale = 0.5 ** (level / 4) / math.sqrt(codec.latent_dim)
        means = t.rng(key).standard_normal((codec.codebook_size, codec.latent_dim))
        levels.append((means * scale).astype(np.float32))
        t.put(key, levels[-1])
        t.put(f"tts_model.audio_codec.prvq._variance_list.{level}.variance",
              np.array(1.0, np.float32))
    t.put("tts_model.tts_model.rvq_embs", np.stack(levels))
