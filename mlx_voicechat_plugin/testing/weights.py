"""Synthetic weights for fixture checkpoints, in the converted on-disk layout.

Tensors carry NeMo/PyTorch names and layouts (``[out, in, k]`` convolutions,
``weight_ih_l0`` LSTMs, ``_control_codes``), exactly as a converted
mlx-community checkpoint stores them. Every shape comes from
:class:`~mlx_voicechat_plugin.config.ModelConfig`.

Values are random but not arbitrary (:mod:`.tensors`: how each tensor is
drawn, and the :class:`~.tensors.Tuning` that makes greedy decoding varied).
Here: the language model, perception and the RNNT, and :func:`build_weights`;
the speech side (EAR-TTS, codec) is :mod:`.speech_weights`.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import mlx.core as mx
import numpy as np

from mlx_audio.utils import hanning, mel_filters

from ..config import AudioConfig, ModelConfig
from .speech_weights import codec_weights, tts_weights
from .tensors import TUNINGS, Directions, Tensors, Tuning

__all__ = ["TUNINGS", "Tuning", "build_weights"]

# Real checkpoints store their FastConformer frontend buffers; loaders drop them.
_MEL_PREFIX = "stt_model.perception.preprocessor.featurizer"


# Rows of a device-drawn token table made and evaluated at once: the full size's
# tables are 131072 x 4480 (2.2 GiB of float32 each), and their vectorised
# tuning would hold several such temporaries if drawn whole.
TABLE_BLOCK_ROWS = 8192


def _device_table(t: Tensors, key: str, vocab: int, hidden: int,
                  tune: Callable[[mx.array, int, int], mx.array]) -> None:
    """A ``[vocab, hidden]`` table drawn block by block of rows (block ``start``'s draw
    keyed by ``key@start``; the first by ``key`` itself), each tuned by ``tune(rows,
    start, stop)`` and cast to bfloat16 before the next is drawn."""
    blocks = []
    for start in range(0, vocab, TABLE_BLOCK_ROWS):
        stop = min(start + TABLE_BLOCK_ROWS, vocab)
        name = key if start == 0 else f"{key}@{start}"
        block = tune(t.standard_normal(name, (stop - start, hidden)), start, stop)
        blocks.append(block.astype(mx.bfloat16))
        mx.eval(blocks[-1])
    t.put(key, mx.concatenate(blocks) if len(blocks) > 1 else blocks[0])


def _device_token_tables(t: Tensors, config: ModelConfig, tuning: Tuning,
                         dirs: Directions) -> None:
    """The embedding and both heads of :func:`_language_model`, drawn and tuned on the
    device, vectorised (the same rule per token as the host loop)."""
    text = config.text_config
    hidden, vocab = text.hidden_size, text.vocab_size
    root = math.sqrt(hidden)
    basis = mx.array(np.stack([dirs.pad, dirs.eos, dirs.quiet]))  # orthonormal rows
    ordinary = np.ones(vocab, bool)
    ordinary[list(config.special_text_ids)] = False
    signed = mx.stack([basis[0], basis[1], -basis[2]])

    def project_out(rows: mx.array) -> mx.array:
        rows = rows / root
        return rows - (rows @ basis.T) @ basis

    def embedding(rows: mx.array, start: int, stop: int) -> mx.array:
        ids = np.arange(start, stop)
        feedback = signed[mx.array(ids % 3)]
        rows = project_out(rows)
        rows = rows + tuning.feedback * root * mx.array(ordinary[start:stop])[:, None] * feedback
        is_eos = mx.array(ids == config.eos_token_id)[:, None]
        return rows - tuning.feedback * root * is_eos * basis[2]

    _device_table(t, "stt_model.embed_tokens.weight", vocab, hidden, embedding)
    for name, rows_to_dirs, boost in (
        ("lm_head", {config.pad_token_id: dirs.pad, config.eos_token_id: dirs.eos},
         tuning.text_boost),
        ("function_head", {config.pad_token_id: dirs.quiet}, tuning.function_boost),
    ):
        def head(rows: mx.array, start: int, stop: int,
                 rows_to_dirs: dict = rows_to_dirs, boost: float = boost) -> mx.array:
            rows = project_out(rows)
            for token, direction in rows_to_dirs.items():
                if start <= token < stop:
                    i = token - start
                    rows[i] = tuning.special_jitter * rows[i] + boost * mx.array(direction) / root
            return rows

        _device_table(t, f"stt_model.{name}.weight", vocab, hidden, head)


def _language_model(t: Tensors, config: ModelConfig, tuning: Tuning,
                    dirs: Directions) -> None:
    if t.device:
        _device_token_tables(t, config, tuning, dirs)
    else:
        _host_token_tables(t, config, tuning, dirs)
    _language_layers(t, config, tuning)


def _host_token_tables(t: Tensors, config: ModelConfig, tuning: Tuning,
                       dirs: Directions) -> None:
    text = config.text_config
    hidden, vocab = text.hidden_size, text.vocab_size
    root = math.sqrt(hidden)
    p = "stt_model"
    key = f"{p}.embed_tokens.weight"
    embed = dirs.project_out(t.rng(key).standard_normal((vocab, hidden)) / root)
    for token in range(vocab):
        if token == config.eos_token_id:
            embed[token] -= tuning.feedback * root * dirs.quiet
        elif token not in config.special_text_ids:
            cls = (dirs.pad, dirs.eos, -dirs.quiet)[token % 3]
            embed[token] += tuning.feedback * root * cls
    t.put(key, embed.astype(np.float32))

    for name, rows_to_dirs, boost in (
        ("lm_head", {config.pad_token_id: dirs.pad, config.eos_token_id: dirs.eos},
         tuning.text_boost),
        ("function_head", {config.pad_token_id: dirs.quiet}, tuning.function_boost),
    ):
        key = f"{p}.{name}.weight"
        rows = dirs.project_out(t.rng(key).standard_normal((vocab, hidden)) / root)
        for token, direction in rows_to_dirs.items():
            rows[token] = tuning.special_jitter * rows[token] + boost * direction / root
        t.put(key, rows.astype(np.float32))


def _language_layers(t: Tensors, config: ModelConfig, tuning: Tuning) -> None:
    text = config.text_config
    hidden = text.hidden_size
    p = "stt_model"
    heads, head_dim = text.mamba_num_heads, text.mamba_head_dim
    inner = heads * head_dim
    conv_dim = inner + 2 * text.n_groups * text.ssm_state_size
    attn_dim = text.head_dim or hidden // text.num_attention_heads
    for idx, block in enumerate(text.hybrid_override_pattern):
        q = f"{p}.llm.layers.{idx}"
        t.norm(f"{q}.norm", hidden)
        m = f"{q}.mixer"
        if block == "M":
            t.linear(f"{m}.in_proj", inner + conv_dim + heads, hidden, text.mamba_proj_bias)
            t.conv(f"{m}.conv1d", (conv_dim, 1, text.conv_kernel), text.use_conv_bias)
            t.put(f"{m}.A_log", np.log(np.arange(1, heads + 1, dtype=np.float32)), mx.float32)
            t.put(f"{m}.D", np.ones(heads, np.float32))
            # softplus(dt_bias) spans the usual Mamba2 step range [1e-3, 1e-1].
            dt = np.exp(np.linspace(math.log(1e-3), math.log(1e-1), heads)).astype(np.float32)
            t.put(f"{m}.dt_bias", dt + np.log(-np.expm1(-dt)))
            t.norm(f"{m}.norm", inner)
            t.linear(f"{m}.out_proj", hidden, inner, text.mamba_proj_bias,
                     gain=tuning.mixer_out_gain)
        elif block == "*":
            kv = text.num_key_value_heads * attn_dim
            t.linear(f"{m}.q_proj", text.num_attention_heads * attn_dim, hidden,
                     text.attention_bias)
            t.linear(f"{m}.k_proj", kv, hidden, text.attention_bias)
            t.linear(f"{m}.v_proj", kv, hidden, text.attention_bias)
            t.linear(f"{m}.o_proj", hidden, text.num_attention_heads * attn_dim,
                     text.attention_bias, gain=tuning.mixer_out_gain)
        elif block == "-":
            t.linear(f"{m}.up_proj", text.intermediate_size, hidden, text.mlp_bias)
            t.linear(f"{m}.down_proj", hidden, text.intermediate_size, text.mlp_bias,
                     gain=tuning.mixer_out_gain)
        else:
            raise ValueError(f"unsupported Nemotron-H block type {block!r}")
    t.norm(f"{p}.llm.norm_f", hidden)


def _subsampled_features(audio: AudioConfig) -> int:
    """Frequency bins left after the causal stride-2 convolutions."""
    freq = audio.encoder.feat_in
    for _ in range(int(math.log2(audio.encoder.subsampling_factor))):
        freq = freq // 2 + 1  # kernel 3, stride 2, causal padding (2, 1)
    return freq


def _perception(t: Tensors, config: ModelConfig, tuning: Tuning,
                dirs: Directions) -> None:
    audio, enc = config.audio_config, config.audio_config.encoder
    d, ch, bias = enc.d_model, enc.subsampling_conv_channels, enc.use_bias
    p = "stt_model.perception.encoder"
    # Zero-sum first kernels ignore the log-mel level (about -16 in silence)
    # and respond to spectro-temporal change, so frames differ from each other.
    key = f"{p}.pre_encode.conv.0.weight"
    kernel = t.rng(key).standard_normal((ch, 1, 3, 3)).astype(np.float32) / 3.0
    t.put(key, kernel - kernel.mean(axis=(1, 2, 3), keepdims=True))
    t.normal(f"{p}.pre_encode.conv.0.bias", (ch,), 0.02)
    for stage in range(int(math.log2(enc.subsampling_factor)) - 1):
        t.conv(f"{p}.pre_encode.conv.{2 + 3 * stage}", (ch, 1, 3, 3), bias=True)
        t.conv(f"{p}.pre_encode.conv.{3 + 3 * stage}", (ch, ch, 1, 1), bias=True)
    t.linear(f"{p}.pre_encode.out", d, ch * _subsampled_features(audio), bias=True)
    for idx in range(enc.n_layers):
        q = f"{p}.layers.{idx}"
        for norm in ("norm_feed_forward1", "norm_self_att", "norm_conv",
                     "norm_feed_forward2", "norm_out"):
            t.norm(f"{q}.{norm}", d, bias=True)
        for ff in ("feed_forward1", "feed_forward2"):
            t.linear(f"{q}.{ff}.linear1", d * enc.ff_expansion_factor, d, bias)
            t.linear(f"{q}.{ff}.linear2", d, d * enc.ff_expansion_factor, bias)
        for proj in ("linear_q", "linear_k", "linear_v", "linear_out"):
            t.linear(f"{q}.self_attn.{proj}", d, d, bias)
        t.linear(f"{q}.self_attn.linear_pos", d, d)
        for pos_bias in ("pos_bias_u", "pos_bias_v"):
            t.normal(f"{q}.self_attn.{pos_bias}", (enc.n_heads, d // enc.n_heads), 0.02)
        t.conv(f"{q}.conv.pointwise_conv1", (2 * d, d, 1), bias)
        t.conv(f"{q}.conv.depthwise_conv", (d, 1, enc.conv_kernel_size), bias)
        t.norm(f"{q}.conv.batch_norm", d, bias=True)
        t.conv(f"{q}.conv.pointwise_conv2", (d, d, 1), bias)

    out = audio.output_dim
    t.linear("stt_model.perception.proj", out, d)
    key = "stt_model.perception.proj.bias"
    proj_bias = 0.02 * t.rng(key).standard_normal(out).astype(np.float32)
    t.put(key, proj_bias + tuning.audio_bias * math.sqrt(out) * dirs.quiet)

    pre = audio.preprocessor
    fb = mel_filters(pre.sample_rate, pre.n_fft, pre.features, norm="slaney",
                     mel_scale="slaney")
    t.put(f"{_MEL_PREFIX}.fb", np.array(fb)[None])
    t.put(f"{_MEL_PREFIX}.window", np.array(hanning(pre.win_length)))


def _rnnt(t: Tensors, config: ModelConfig, tuning: Tuning) -> None:
    """Prediction LSTM (PyTorch init) and joint; see :class:`Tuning` for the gains."""
    dec, joint = config.audio_config.decoder, config.audio_config.joint
    hidden = dec.pred_hidden
    p = "stt_model.rnnt_decoder.prediction"
    rows = dec.vocab_size + 1 if dec.blank_as_pad else dec.vocab_size
    embed = t.rng(f"{p}.embed.weight").standard_normal((rows, hidden)).astype(np.float32)
    if dec.blank_as_pad:
        embed[dec.vocab_size] = 0.0  # PyTorch padding_idx row
    t.put(f"{p}.embed.weight", embed)
    bound = 1.0 / math.sqrt(hidden)  # PyTorch LSTM init range
    for layer in range(dec.pred_rnn_layers):
        for kind in ("ih", "hh"):
            key = f"{p}.dec_rnn.lstm.weight_{kind}_l{layer}"
            weight = t.rng(key).uniform(-bound, bound, (4 * hidden, hidden))
            t.put(key, weight.astype(np.float32))
            key = f"{p}.dec_rnn.lstm.bias_{kind}_l{layer}"
            t.put(key, t.rng(key).uniform(-bound, bound, 4 * hidden).astype(np.float32))

    q = "stt_model.rnnt_joint"
    t.linear(f"{q}.enc", joint.joint_hidden, joint.encoder_hidden, bias=True)
    t.linear(f"{q}.pred", joint.joint_hidden, joint.pred_hidden, bias=True,
             gain=tuning.rnnt_pred_gain)
    classes = joint.num_classes + 1
    key = f"{q}.joint_net.2.weight"
    out_w = t.rng(key).standard_normal((classes, joint.joint_hidden)).astype(np.float32)
    out_w /= math.sqrt(joint.joint_hidden)
    out_w[config.rnnt_blank_id] *= tuning.rnnt_blank_gain
    t.put(key, out_w)
    key = f"{q}.joint_net.2.bias"
    out_b = 0.02 * t.rng(key).standard_normal(classes).astype(np.float32)
    out_b[config.rnnt_blank_id] += tuning.rnnt_blank_bias
    t.put(key, out_b)


def build_weights(config: ModelConfig, vocab: Mapping[str, int], seed: int = 0,
                  tuning: Tuning | None = None, device: bool = False,
                  sink: Callable[[str, mx.array], None] | None = None) -> dict[str, mx.array]:
    """All checkpoint tensors of ``config``, keyed and laid out as on disk.

    ``device``: draw the large tensors on MLX's default device, lazily (the
    ``full`` size: seconds on a GPU where numpy would take minutes).
    ``sink``: hand each tensor to it as it is drawn instead (the result is
    then empty; see :class:`~.tensors.Tensors`).
    """
    tuning = tuning or Tuning()
    t = Tensors(seed, device=device, sink=sink)
    dirs = Directions.draw(t, config.text_config.hidden_size)
    _language_model(t, config, tuning, dirs)
    _perception(t, config, tuning, dirs)
    _rnnt(t, config, tuning)
    tts_weights(t, config, vocab)
    codec_weights(t, config.codec_config, tuning)
    return dict(sorted(t.arrays.items()))
