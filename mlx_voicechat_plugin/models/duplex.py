"""The duplex speech-to-text side: fused-channel Nemotron-H with text and function heads.

Each timeline position feeds one fused embedding
``E(prev_text) + audio + w * E(prev_function)`` (``w`` =
``function_channel_weight``) and reads a text token and a function-channel
token from two heads over the same hidden state.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr.rnnt import JointNetwork, PredictNetwork
from mlx_vlm.models.cache import ArraysCache, KVCache
from mlx_vlm.models.nemotron_h.language import NemotronHModel

from ..config import ModelConfig
from .perception import Perception
from .segments import SegmentedStep


class DuplexSTT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        text = config.text_config
        self.function_weight = config.function_channel_weight
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.llm = NemotronHModel(text, with_embeddings=False)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.function_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.perception = Perception(config.audio_config)
        self.rnnt_decoder = PredictNetwork(config.audio_config.decoder)
        self.rnnt_joint = JointNetwork(config.audio_config.joint)
        self._segments: SegmentedStep | None = None

    def fuse(self, prev_text: mx.array, audio: mx.array, prev_function: mx.array) -> mx.array:
        """One fused input embedding per position; token ids are ``(B, T)``."""
        return (
            self.embed_tokens(prev_text)
            + audio
            + self.function_weight * self.embed_tokens(prev_function)
        )

    def __call__(
        self, inputs_embeds: mx.array, cache: list[Any] | None = None
    ) -> tuple[mx.array, mx.array]:
        """Return ``(text_logits, function_logits)`` for every input position."""
        hidden = self.llm(inputs_embeds=inputs_embeds, cache=cache)
        return self.lm_head(hidden), self.function_head(hidden)

    def _head(self, hidden: mx.array) -> tuple[mx.array, mx.array]:
        hidden = self.llm.norm_f(hidden)
        return self.lm_head(hidden), self.function_head(hidden)

    def step(self, inputs_embeds: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """One cached position: the same logits as ``self(x, cache)``, compiled where shapes are fixed.

        The first position (Mamba states not yet created) runs uncompiled.
        """
        if self._segments is None:
            self._segments = SegmentedStep(self.llm.layers, self._head)
        if not self._segments.ready(inputs_embeds, cache):
            return self(inputs_embeds, cache=cache)
        text, function = self._segments(inputs_embeds, cache)
        return text, function

    def step_batch(self, inputs_embeds: mx.array, caches: list[list[Any]]
                   ) -> tuple[mx.array, mx.array]:
        """One cached position of many sessions (row ``b`` with ``caches[b]``) in one call.

        Each row's logits equal :meth:`step` on that row alone. Sessions whose
        Mamba states do not exist yet (their first position) run alone.
        """
        if self._segments is None:
            self._segments = SegmentedStep(self.llm.layers, self._head)
        rows = [inputs_embeds[b : b + 1] for b in range(len(caches))]
        if all(self._segments.ready(r, c) for r, c in zip(rows, caches)):
            return self._segments.batch(inputs_embeds, caches)
        outs = [self.step(r, c) for r, c in zip(rows, caches)]
        return (mx.concatenate([t for t, _ in outs]), mx.concatenate([f for _, f in outs]))

    def make_cache(self) -> list[Any]:
        """Mamba2 state for ``M`` layers and a growing KV cache for ``*`` layers."""
        caches: list[Any] = []
        for layer in self.llm.layers:
            if layer.block_type == "M":
                caches.append(ArraysCache(size=2))
            elif layer.block_type == "*":
                caches.append(KVCache())
        return caches
