"""The duplex speech-to-text side: fused-channel Nemotron-H with text and function heads.

Each timeline position feeds one fused embedding
``E(prev_text) + audio + w * E(prev_function)`` (``w`` =
``function_channel_weight``) and reads a text token and a function-channel
token from two heads over the same hidden state.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr.rnnt import JointNetwork, PredictNetwork
from mlx_vlm.models.cache import ArraysCache, KVCache
from mlx_vlm.models.nemotron_h.language import NemotronHModel

from ...config import ModelConfig
from ..cache_state import (
    MetaState,
    cache_meta_state,
    cache_state,
    caches_from_state,
    state_nbytes,
)
from .context import ContextCache, ContextWindow
from ..kv_arena import ArenaAttention, KVArena, stack_layer
from ..perception.perception import Perception
from ..rows import drop_row, own_row, stack_rows
from ..segments import SegmentedStep


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
        self.arena_attention = ArenaAttention()  # a setting: batched or per-row cores

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

    def step(self, inputs_embeds: mx.array, states: Sequence["LanguageState"]
             ) -> tuple[mx.array, mx.array]:
        """One position of ``B`` conversations: row ``b`` of ``inputs_embeds`` (``(B, 1, H)``)
        reads and advances ``states[b]``. Returns the position's text and function
        logits, ``(B, 1, V)`` each.

        One state of stacked rows (:class:`LanguageRows`, a batch's) or one
        ready row (every Mamba2 state exists) runs through the compiled runs
        (:class:`SegmentedStep`) as it is. Several states (a batch whose rows
        are not all ready yet: its ready rows stacked, each other row on its
        own) take their rows of ``inputs_embeds`` in order: a ready one through
        the compiled runs, one at its first position or without a cache (full
        recompute) through the plain modules. Every row equals that row run
        alone, bit for bit.
        """
        if len(states) == 1 and self.ready(states[0]):  # one row, or a stacked batch
            return self._segments(inputs_embeds, states[0].cache)
        outs, start = [], 0
        for state in states:
            x, start = inputs_embeds[start : start + state.batch_size], start + state.batch_size
            outs.append(self._segments(x, state.cache) if self.ready(state)
                        else self._alone(x, state))
        return mx.concatenate([t for t, _ in outs]), mx.concatenate([f for _, f in outs])

    def ready(self, state: "LanguageState") -> bool:
        """``state`` steps through the compiled runs (stacked rows, or its Mamba2 states exist)."""
        if self._segments is None:
            self._segments = SegmentedStep(self.llm.layers, self._head, self.arena_attention)
        return isinstance(state, LanguageRows) or (
            state.cache is not None and self._segments.ready(state.cache))

    def _alone(self, x: mx.array, state: "LanguageState") -> tuple[mx.array, mx.array]:
        """One row through the plain modules: its cache, or the whole history again."""
        if state.cache is not None:
            text, function = self(x, cache=state.cache)
        else:
            state.history.append(x)
            text, function = self(mx.concatenate(state.history, axis=1))
        return text[:, -1:], function[:, -1:]

    def make_state(self, use_cache: bool = True,
                   context: ContextWindow | None = None) -> "LanguageState":
        """A conversation's fresh language state (``use_cache=False``: full recompute,
        which is unbounded whatever ``context`` says)."""
        return LanguageState(self.make_cache(context) if use_cache else None)

    def make_cache(self, context: ContextWindow | None = None) -> list[Any]:
        """Mamba2 state for ``M`` layers and a KV cache for ``*`` layers: growing, or
        with ``context`` a ring of its sink and recent positions (:mod:`.context`)."""
        return [ArraysCache(size=2) if layer.block_type == "M"
                else KVCache() if context is None else ContextCache(context)
                for layer in self.llm.layers if layer.block_type in ("M", "*")]


class LanguageState:
    """One conversation's Nemotron-H state across positions, in mlx-lm's cache style.

    With the cache, ``cache`` (:meth:`DuplexSTT.make_cache`: a Mamba2
    ``ArraysCache`` and an attention ``KVCache`` per layer); without it,
    ``history``, every fused input so far (the reference's default full
    recompute). ``state`` is its arrays, ``meta_state`` the host values that
    rebuild it (:meth:`from_state`).

    Batching: :class:`LanguageRows` stacks ready rows' Mamba2 states into one
    ``[B, ...]`` cache per layer for as long as the same rows step, and gives
    each row its slices back into its own ``ArraysCache`` when the batch
    changes (so a conversation keeps its cache objects); an attention row
    always reads and writes its own KV cache, never a cache merged or padded
    to a common length (padding would change the attention's reduction and
    the bits).
    """

    def __init__(self, cache: list[Any] | None, history: list[mx.array] | None = None):
        self.cache = cache
        self.history: list[mx.array] = [] if history is None else history

    @property
    def state(self) -> list[mx.array]:
        return cache_state(self.cache) if self.cache is not None else list(self.history)

    @property
    def batch_size(self) -> int:
        """The rows it holds: one conversation's."""
        return 1

    @property
    def nbytes(self) -> int:
        """The bytes of ``state`` (:func:`~.cache_state.state_nbytes`)."""
        return (state_nbytes(self.cache) if self.cache is not None
                else sum(a.nbytes for a in self.history))

    @property
    def meta_state(self) -> tuple[str, MetaState | int]:
        return (("cache", cache_meta_state(self.cache)) if self.cache is not None
                else ("history", len(self.history)))

    @classmethod
    def from_state(cls, state: list[mx.array], meta_state: tuple[str, Any]) -> "LanguageState":
        kind, meta = meta_state
        return cls(caches_from_state(state, meta)) if kind == "cache" else cls(None, list(state))

    def release(self) -> None:
        self.cache, self.history = None, []


class LanguageRows(LanguageState):
    """Ready rows' language states stepped as one (mlx-lm's merged batch cache): each
    Mamba2 layer's states stacked ``[B, ...]`` in one ``ArraysCache``, each attention
    layer the rows' rings as one :class:`~.kv_arena.KVArena` (else the list of the rows'
    own KV caches). Made when the batch forms, emptying the rows' own caches (the stack
    is their only copy); its rows take their slices back (:meth:`extract`) when it
    changes."""

    def __init__(self, rows: Sequence[LanguageState]):
        """``rows``: one-row states, or stacked ones whose rows are appended in order."""
        self.rows = [r for s in rows for r in (s.rows if isinstance(s, LanguageRows) else [s])]
        stacked = [  # every row is ready: its cache exists
            stack_layer(layer, 1) if not isinstance(layer[0], ArraysCache) else
            ArraysCache.from_state([stack_rows(a) for a in zip(*(c.cache for c in layer))], "")
            for layer in zip(*(s.cache for s in rows))]
        super().__init__(stacked)
        # A row's share of the stacked states (their shapes do not change while stacked).
        self._mamba_bytes = sum(a.nbytes for c in stacked if isinstance(c, ArraysCache)
                                for a in c.cache) // len(self.rows)
        for row in rows:  # held here: a row keeps no second copy (extract writes it back)
            for own in row.cache if not isinstance(row, LanguageRows) else ():
                if isinstance(own, ArraysCache):
                    own.cache = [None] * len(own.cache)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def extract(self, index: int, copy: bool = True) -> LanguageState:
        """Row ``index``'s own state, its Mamba2 rows written back into its caches
        (copies; ``copy=False``: slices, for a row stacked again)."""
        row = self.rows[index]
        for own, cache in zip(row.cache, self.cache):
            if isinstance(cache, ArraysCache):
                own.cache = [own_row(a, index, copy) for a in cache.cache]
            elif isinstance(cache, KVArena):
                cache.extract(index, copy)
        return row

    @property
    def state(self) -> list[mx.array]:
        """The stacked Mamba2 states and the rows' KV rings (to evaluate them)."""
        return [a for c in self.cache for a in (cache_state(c) if isinstance(c, list)
                                                 else c.state)]

    def remove(self, index: int) -> LanguageState:
        """Row ``index``'s own state (its Mamba2 rows copied back into its caches); the
        others stay stacked."""
        row = self.extract(index)
        self.rows.pop(index)
        for layer in self.cache:
            if isinstance(layer, ArraysCache):
                layer.cache = [drop_row(a, index) for a in layer.cache]
            elif isinstance(layer, KVArena):
                layer.filter([b for b in range(layer.sessions) if b != index])
            else:
                layer.pop(index)
        return row

    def row_nbytes(self, index: int) -> int:
        """Row ``index``'s share of the stacked states and its KV rings' bytes."""
        return self._mamba_bytes + sum(
            c.row_nbytes(index) if isinstance(c, KVArena) else state_nbytes([c[index]])
            for c in self.cache if not isinstance(c, ArraysCache))
