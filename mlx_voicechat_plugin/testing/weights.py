"""Synthetic weights for fixture checkpoints, in the converted on-disk layout.

Tensors carry NeMo/PyTorch names and layouts (``[out, in, k]`` convolutions,
``weight_ih_l0`` LSTMs, ``_control_codes``), exactly as a converted
mlx-community checkpoint stores them. Every shape comes from
:class:`~mlx_voicechat_plugin.config.ModelConfig`.

Values are random but not arbitrary: each tensor has its own generator (seeded by
``seed`` and its name, so adding a tensor never shifts another), linear weights
are scaled by ``1/sqrt(fan_in)``, norms start near identity, and a few biases
are shaped (see :class:`Tuning`) so that offline decoding of a short synthetic
signal emits pad, EOS and ordinary text tokens, a mostly-pad function channel
and both blank and non-blank RNNT symbols.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx
import numpy as np

from mlx_audio.utils import hanning, mel_filters

from ..config import AudioConfig, CodecConfig, ModelConfig, TTSConfig
from .tokenizers import WORD_START_MARKER


CONTROL_CODE_COUNT = 3
# Real checkpoints store their FastConformer frontend buffers; loaders drop them.
_MEL_PREFIX = "stt_model.perception.preprocessor.featurizer"


@dataclass(frozen=True)
class Tuning:
    """Knobs that make the random model's greedy outputs varied.

    The language model carries three orthonormal directions of its residual
    stream: ``pad`` and ``eos`` (read by the text head's pad / EOS rows) and
    ``quiet`` (read by the function head's pad row). Every audio embedding holds
    a constant ``quiet`` offset, so the function channel is mostly pad. Ordinary
    text tokens fall into three classes by id; their embeddings point along
    ``pad``, ``eos`` or against ``quiet``, so the token emitted after them is
    pad, EOS, or an ordinary token with a non-pad function token (as after
    EOS). The greedy text stream then cycles through all of them, for any seed,
    because each decision has a margin of several logits.
    """

    # Offset along ``quiet`` in every audio embedding, per channel.
    audio_bias: float = 1.25
    # Feedback of ordinary-token embeddings along their class direction, per channel.
    feedback: float = 1.5
    # Logit gain of the text pad / EOS rows and the function pad row.
    text_boost: float = 8.0
    function_boost: float = 8.0
    # Fraction of their random part the boosted head rows keep.
    special_jitter: float = 0.5
    # Gain of the Nemotron-H mixer output projections (residual branch size).
    mixer_out_gain: float = 0.5
    # Bias of the blank class in the RNNT joint output layer.
    rnnt_blank_bias: float = 0.0
    # Gain of the joint's prediction projection (how much the history matters)
    # and of its blank row (how much blank varies with frame and history).
    rnnt_pred_gain: float = 6.0
    rnnt_blank_gain: float = 4.0
    # Mean log-magnitude of the codec's decoded spectrum (keeps the audio quiet).
    codec_log_magnitude: float = -5.0


# The RNNT branch is tuned per size for seed 0 (its blank/emit balance depends
# on the encoder's random features); the text and function channels need not be.
TUNINGS: dict[str, Tuning] = {
    "tiny": Tuning(),
    "small": Tuning(rnnt_pred_gain=2.0, rnnt_blank_bias=4.0),
}


class _Tensors:
    """Accumulates named tensors; one seeded generator per name.

    ``device=True`` (the ``full`` size) draws the large tensors (every
    :meth:`normal`, and the language model's embedding and heads) with
    ``mx.random`` on the default device, one key per name, lazily, instead
    of numpy on the host; small tuned tensors still come from numpy.
    """

    def __init__(self, seed: int, device: bool = False):
        self.seed = seed
        self.device = device
        self.arrays: dict[str, mx.array] = {}

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def key(self, name: str) -> mx.array:
        return mx.random.key((self.seed << 32) | zlib.crc32(name.encode()))

    def standard_normal(self, name: str, shape: tuple[int, ...]) -> mx.array:
        """A float32 standard normal draw on the device (``device`` mode)."""
        return mx.random.normal(shape, key=self.key(name))

    def put(self, name: str, value: np.ndarray, dtype: mx.Dtype = mx.bfloat16) -> None:
        if name in self.arrays:
            raise KeyError(f"duplicate tensor {name}")
        self.arrays[name] = mx.array(value).astype(dtype)

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> np.ndarray | mx.array:
        if self.device:
            value = self.standard_normal(name, shape) * std
        else:
            value = self.rng(name).standard_normal(shape).astype(np.float32) * std
        self.put(name, value)
        return value

    def linear(self, name: str, out_dim: int, in_dim: int, bias: bool = False,
               gain: float = 1.0) -> None:
        self.normal(f"{name}.weight", (out_dim, in_dim), gain / math.sqrt(in_dim))
        if bias:
            self.normal(f"{name}.bias", (out_dim,), 0.02)

    def conv(self, name: str, shape: tuple[int, ...], bias: bool = False,
             fan_in: int | None = None) -> None:
        fan_in = fan_in or int(np.prod(shape[1:]))
        self.normal(f"{name}.weight", shape, 1.0 / math.sqrt(fan_in))
        if bias:
            self.normal(f"{name}.bias", (shape[0],), 0.02)

    def norm(self, name: str, dim: int, *, offset: bool = False, bias: bool = False) -> None:
        """A norm weight near identity: ~1, or ~0 for ``1 + w`` (Gemma) norms."""
        value = self.rng(f"{name}.weight").standard_normal(dim).astype(np.float32) * 0.02
        self.put(f"{name}.weight", value if offset else 1.0 + value)
        if bias:
            self.normal(f"{name}.bias", (dim,), 0.02)


@dataclass(frozen=True)
class _Directions:
    pad: np.ndarray
    eos: np.ndarray
    quiet: np.ndarray

    @classmethod
    def draw(cls, tensors: _Tensors, dim: int) -> "_Directions":
        basis = tensors.rng("tuning.directions").standard_normal((dim, 3))
        q, _ = np.linalg.qr(basis)
        return cls(*(q[:, i].astype(np.float32) for i in range(3)))

    def project_out(self, rows: np.ndarray) -> np.ndarray:
        for d in (self.pad, self.eos, self.quiet):
            rows = rows - np.outer(rows @ d, d)
        return rows


def _device_token_tables(t: _Tensors, config: ModelConfig, tuning: Tuning,
                         dirs: _Directions) -> None:
    """The embedding and both heads of :func:`_language_model`, drawn and tuned on the
    device, vectorised (the same rule per token as the host loop)."""
    text = config.text_config
    hidden, vocab = text.hidden_size, text.vocab_size
    root = math.sqrt(hidden)
    basis = mx.array(np.stack([dirs.pad, dirs.eos, dirs.quiet]))  # orthonormal rows

    def project_out(rows: mx.array) -> mx.array:
        return rows - (rows @ basis.T) @ basis

    key = "stt_model.embed_tokens.weight"
    embed = project_out(t.standard_normal(key, (vocab, hidden)) / root)
    ordinary = np.ones(vocab, bool)
    ordinary[list(config.special_text_ids)] = False
    classes = mx.array(np.arange(vocab) % 3)
    feedback = mx.stack([basis[0], basis[1], -basis[2]])[classes]
    embed = embed + tuning.feedback * root * mx.array(ordinary)[:, None] * feedback
    is_eos = mx.array(np.arange(vocab) == config.eos_token_id)[:, None]
    embed = embed - tuning.feedback * root * is_eos * basis[2]
    t.put(key, embed)
    for name, rows_to_dirs, boost in (
        ("lm_head", {config.pad_token_id: dirs.pad, config.eos_token_id: dirs.eos},
         tuning.text_boost),
        ("function_head", {config.pad_token_id: dirs.quiet}, tuning.function_boost),
    ):
        key = f"stt_model.{name}.weight"
        rows = project_out(t.standard_normal(key, (vocab, hidden)) / root)
        for token, direction in rows_to_dirs.items():
            rows[token] = tuning.special_jitter * rows[token] + boost * mx.array(direction) / root
        t.put(key, rows)


def _language_model(t: _Tensors, config: ModelConfig, tuning: Tuning,
                    dirs: _Directions) -> None:
    if t.device:
        _device_token_tables(t, config, tuning, dirs)
    else:
        _host_token_tables(t, config, tuning, dirs)
    _language_layers(t, config, tuning)


def _host_token_tables(t: _Tensors, config: ModelConfig, tuning: Tuning,
                       dirs: _Directions) -> None:
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


def _language_layers(t: _Tensors, config: ModelConfig, tuning: Tuning) -> None:
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


def _perception(t: _Tensors, config: ModelConfig, tuning: Tuning,
                dirs: _Directions) -> None:
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


def _rnnt(t: _Tensors, config: ModelConfig, tuning: Tuning) -> None:
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


def _gemma_attention(t: _Tensors, p: str, hidden: int, heads: int, kv_heads: int,
                     head_dim: int) -> None:
    t.linear(f"{p}.q_proj", heads * head_dim, hidden)
    t.linear(f"{p}.k_proj", kv_heads * head_dim, hidden)
    t.linear(f"{p}.v_proj", kv_heads * head_dim, hidden)
    t.linear(f"{p}.o_proj", hidden, heads * head_dim)


def _gated_mlp(t: _Tensors, p: str, hidden: int, inner: int) -> None:
    t.linear(f"{p}.gate_proj", inner, hidden)
    t.linear(f"{p}.up_proj", inner, hidden)
    t.linear(f"{p}.down_proj", hidden, inner)


def _tts(t: _Tensors, config: ModelConfig, vocab: Mapping[str, int]) -> None:
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


def _subword_buffers(t: _Tensors, p: str, table_size: int, config: ModelConfig,
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


def _convnext(t: _Tensors, p: str, channels: int, kernel: int) -> None:
    t.conv(f"{p}.dwconv", (channels, 1, kernel), bias=True)
    t.norm(f"{p}.norm", channels, bias=True)
    t.conv(f"{p}.pwconv1", (4 * channels, channels, 1), bias=True)
    t.conv(f"{p}.pwconv2", (channels, 4 * channels, 1), bias=True)


def _quiet_output_conv(t: _Tensors, bias_key: str, weight_key: str, codec: CodecConfig,
                       log_magnitude: float) -> None:
    """Final decoder conv whose magnitude logits sit near ``log_magnitude``.

    The last ConvNeXt block adds a constant ``offset`` to its output (its
    ``pwconv2`` bias); the magnitude rows of the 1x1 output conv read it back as
    a constant logit, so the decoded spectrum, and the waveform, stay quiet.
    """
    width = codec.stage_channels[0]
    offset = t.rng(bias_key).standard_normal(width).astype(np.float32)
    offset *= 4.0 / np.linalg.norm(offset) * math.sqrt(width)
    t.arrays.pop(bias_key)
    t.put(bias_key, offset)
    unit = offset / np.linalg.norm(offset)
    rows = t.rng(weight_key).standard_normal((2 * codec.stft_bins, width)) / math.sqrt(width)
    rows -= np.outer(rows @ unit, unit)
    rows[: codec.stft_bins] += log_magnitude * offset / float(offset @ offset)
    t.put(weight_key, rows[..., None].astype(np.float32))


def _codec(t: _Tensors, codec: CodecConfig, tuning: Tuning) -> None:
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
    for width, rate in zip(reversed(channels), reversed(codec.downsample_rates)):
        # ConvTranspose1d weights are [in, out, kernel] in PyTorch.
        t.conv(f"{dec}.{idx}", (source, width, rate), fan_in=source)
        idx += 1
        for _ in range(codec.blocks_per_stage):
            _convnext(t, f"{dec}.{idx}", width, codec.block_kernel_size)
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


def build_weights(config: ModelConfig, vocab: Mapping[str, int], seed: int = 0,
                  tuning: Tuning | None = None, device: bool = False) -> dict[str, mx.array]:
    """All checkpoint tensors of ``config``, keyed and laid out as on disk.

    ``device``: draw the large tensors on MLX's default device, lazily (the
    ``full`` size: seconds on a GPU where numpy would take minutes).
    """
    tuning = tuning or Tuning()
    t = _Tensors(seed, device=device)
    dirs = _Directions.draw(t, config.text_config.hidden_size)
    _language_model(t, config, tuning, dirs)
    _perception(t, config, tuning, dirs)
    _rnnt(t, config, tuning)
    _tts(t, config, vocab)
    _codec(t, config.codec_config, tuning)
    return dict(sorted(t.arrays.items()))
