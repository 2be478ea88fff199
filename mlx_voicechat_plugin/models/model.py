"""The whole Nemotron VoiceChat network as stored in a checkpoint.

``stt_model`` is the duplex speech-to-text side (perception, RNNT, Nemotron-H);
``tts_model`` holds EAR-TTS, the codec and the speaker prompt buffers.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..config import ModelConfig
from .language.duplex import DuplexSTT
from .fast_forms import expand_layer_norms
from .kv_arena import batched_by_default
from .speech.speech import SpeechDecoder
from .fused import fuse_projections, fused_layers, unfuse
from .remembered import ProbeVerdicts
from .weight_layout import channels_last, hold_matrices, relayout, sanitize_under

# Deterministic mel filterbank / window buffers of the NeMo featurizer; the
# frontend rebuilds them, so they are dropped at load.
_MEL_BUFFER_PREFIX = "stt_model.perception.preprocessor."
_LSTM_MARKER = ".dec_rnn.lstm."
# PyTorch LSTM tensor -> MLX LSTM parameter (its two biases are summed into one).
_LSTM_NAMES = {"weight_ih": "Wx", "weight_hh": "Wh", "bias_ih": "bias", "bias_hh": "bias"}


# What create_session makes, found by name when it is called: the runtime builds its
# sessions from a model, and model code imports no runtime (nor does the runtime set
# anything here when it is imported).
RUNTIME = ("..runtime.voicechat", "VoiceChat")


class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model_type = config.model_type
        self.stt_model = DuplexSTT(config)
        self.tts_model = SpeechDecoder(config.tts_config, config.codec_config)

    def __call__(self, inputs_embeds: mx.array, cache: list[Any] | None = None, **_: Any):
        return self.stt_model(inputs_embeds, cache=cache)

    @property
    def layers(self) -> list[nn.Module]:
        return self.stt_model.llm.layers

    def set_batched_cores(self, on: bool | None) -> None:
        """Attend a batch's rows in one core per layer (``True``) or each row on its own
        ring (``False``, the exact path on any backend); ``None``: the environment's
        default (:func:`~.kv_arena.batched_by_default`). A setting of this model's
        stacks, read by each step."""
        batched = batched_by_default() if on is None else on
        self.stt_model.arena_attention.batched = batched
        self.tts_model.tts_model.arena_attention.batched = batched

    def prepare(self, tokenizer: Any) -> None:
        """One-time setup after the weights are loaded (``load`` calls it).

        The TTS's subword spellings come from the LLM tokenizer's vocabulary,
        and its codebook tables from the loaded weights. Sessions only read them.
        The float32 weight matrices are stored transposed where that gives the
        same bits faster (``weight_layout``), and projections of one input are
        stacked into one product where that gives the same bits (``fused``);
        each layer's matrix is held as the view its product reads (``weight_layout``);
        the LayerNorms run their fewer-kernel exact form where ``mx.fast`` ops
        expand (``fast_forms``); before any compiled step is traced.
        """
        self.expanded_layer_norms = expand_layer_norms(self)
        # The MoG head reads ``proj_mus`` block by block, never as a layer.
        self.layout_moved = relayout(self, skip=lambda name: name.endswith(".proj_mus"))
        tts = self.tts_model.tts_model
        # The projections the one-position steps read together, as one product each.
        self.fused_blocks = fuse_projections(self._projection_blocks(), ProbeVerdicts.default())
        # Every layer's matrix (``weight.T``) as a held view: a leaf of the graphs.
        self.held_matrices = hold_matrices(self, fused_layers(self._projection_blocks()))
        self.tts_model.audio_codec.prvq.stack()  # one gather for a frame's codebooks
        tts.set_vocabulary(tokenizer.get_vocab())
        tts.hold_f32 = self.holds_f32
        tts.prepare()
        self.prepared_for = tokenizer

    @property
    def holds_f32(self) -> bool:
        """Whether float32 copies of lower-precision weights and tables are held (the
        memory plan's choice, ``loader``; held where there is no plan)."""
        plan = getattr(self, "memory_plan", None)
        return True if plan is None else bool(plan.hold_f32)

    def _projection_blocks(self) -> list[nn.Module]:
        tts = self.tts_model.tts_model
        return ([block for layer in tts.backbone.layers for block in (layer.self_attn, layer.mlp)]
                + [layer.self_attn for layer in self.stt_model.perception.encoder.layers]
                + [layer.mixer for layer in self.layers if layer.block_type == "*"]
                + [residual.mlp for residual in tts.mog_head.mlp_stack[:-1]]
                + [tts.mog_head])

    def update(self, parameters: dict, strict: bool = True) -> "Model":
        unfuse(self._projection_blocks())  # the stacks hold the weights being replaced
        # Its weights are no longer the checkpoint's: nothing remembered of it applies.
        self.__dict__.pop("checkpoint_path", None)
        # nn.Module.update sets the children's parameters without calling their
        # update: the tables derived from replaced weights are dropped here.
        for _, module in self.named_modules():
            if hasattr(module, "forget_derived"):
                module.forget_derived()
        return super().update(parameters, strict=strict)

    def create_session(self, processor: Any):
        """The offline / streaming runtime for this model and its tokenizer (mlx-vlm's
        ``model.create_session(processor)``): ``runtime.voicechat.VoiceChat(model, processor)``.

        The runtime's own state lives there, not on the model: the EAR-TTS warm
        start (computed when it is made) and the prompt cache. Make one and
        keep it; every session it makes shares them. Model code does not import
        the runtime: :data:`RUNTIME` names it, looked up here.
        """
        module, name = RUNTIME
        return getattr(importlib.import_module(module, __package__), name)(self, processor)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map checkpoint tensors onto this module tree. Idempotent.

        - drops the featurizer's mel buffers;
        - PyTorch LSTM ``weight_ih_lK/weight_hh_lK`` -> ``K.Wx/K.Wh`` and the two
          bias vectors summed into ``K.bias`` (MLX's LSTM has one bias);
        - perception conv kernels and the Mamba2 ``conv1d`` move channels last;
        - ``tts_model.*`` is handled by :class:`SpeechDecoder`.
        """
        expected = {k: tuple(v.shape) for k, v in tree_flatten(self.parameters())}
        out: dict[str, mx.array] = {}
        lstm: dict[str, list[mx.array]] = {}
        for key, value in sanitize_under("tts_model.", weights, self.tts_model.sanitize).items():
            if key.startswith(_MEL_BUFFER_PREFIX):
                continue
            if _LSTM_MARKER in key:
                stem, name = key.split(_LSTM_MARKER, 1)
                kind, _, layer = name.rpartition("_l")
                if kind in _LSTM_NAMES:
                    target = f"{stem}{_LSTM_MARKER}{layer}.{_LSTM_NAMES[kind]}"
                    lstm.setdefault(target, []).append(value)
                    continue
            is_conv = value.ndim in (3, 4) and (
                key.startswith("stt_model.perception.") or key.endswith(".conv1d.weight")
            )
            if is_conv and key in expected:
                value = channels_last(key, value, expected[key])
            out[key] = value
        for key, parts in lstm.items():
            out[key] = parts[0] + parts[1] if len(parts) == 2 else parts[0]
        return out
