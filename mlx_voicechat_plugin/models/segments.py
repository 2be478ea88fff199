"""Decode steps of layer stacks with their fixed-shape runs compiled.

On a one-position step most of a stack has inputs and state of constant shape:
Nemotron-H's Mamba2 layers (conv and SSM state), its MLP layers, and the
final norm and heads. Only attention, whose KV cache grows, changes shape
every step. :class:`SegmentedStep` splits a Nemotron-H stack at its attention layers and
runs each attention-free run of layers as one ``mx.compile``'d pure function
of ``(x, *state) -> (x, *state)``, so MLX traces it once and fuses its
elementwise work; attention layers run as usual between them. The layers'
own ``__call__`` does the arithmetic, so the outputs are the uncompiled
step's (:class:`~.gemma_step.GemmaStep` does the same for a Gemma-3 stack). On CPU, where per-op dispatch dominates small frames, this is the
largest saving of the frame. Both run one position of many independent
streams (each with its own caches, at its own offset): the compiled spans
once over all their rows, the attention cores per stream; one stream is the
case of one row.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_vlm.models.base import scaled_dot_product_attention
from mlx_vlm.models.cache import ArraysCache

from .fused import project
from .kv_arena import ArenaAttention, StepArrays
from .language.mamba_step import MambaStep, use_upstream
from .rows import stack_rows

MAMBA, ATTENTION = "M", "*"


class _Run:
    """One compiled run of attention-free layers (and, last, the head)."""

    def __init__(self, layers: list[Any], cache_index: list[int | None], head: Callable | None):
        self.layers = layers
        self.cache_index = cache_index  # per layer: its cache slot, None for MLP
        self.slots = [s for s in cache_index if s is not None]
        self.head = head
        # Mamba2 layers step through MambaStep (exact, without the chunked scan's
        # dead work) except on Metal, where upstream's step is one dedicated kernel.
        upstream = use_upstream()
        self.steps = [None if s is None or upstream else MambaStep(layer)
                      for layer, s in zip(layers, cache_index)]
        self._compiled = mx.compile(self._pure)

    def _pure(self, x: mx.array, *state: mx.array) -> tuple[mx.array, ...]:
        new_state: list[mx.array] = []
        carried = iter(state)
        for layer, slot, step in zip(self.layers, self.cache_index, self.steps):
            if slot is None:
                x = layer(x)
            elif step is not None:
                x, *pair = step(x, next(carried), next(carried))
                new_state += pair
            else:
                cache = ArraysCache(size=2)
                cache[0], cache[1] = next(carried), next(carried)
                x = layer(x, mask=None, cache=cache)
                new_state += [cache[0], cache[1]]
        if self.head is None:
            outputs: tuple[mx.array, ...] = (x,)
        elif x.ndim == 2:  # rows: the heads' outputs as the stack's (B, 1, V)
            outputs = tuple(o[:, None] for o in self.head(x))
        else:
            outputs = tuple(self.head(x))
        return (*outputs, *new_state)

    def __call__(self, x: mx.array, caches: Sequence[Any]) -> tuple[mx.array, ...]:
        """Every row of ``x`` with the Mamba2 states of ``caches`` (each slot's
        ``ArraysCache`` holds ``[B, ...]`` arrays, one row per stream): one call for
        all rows, each slot's new states written back into its cache. Every op of
        the run is row-independent, so a row equals its own step."""
        state = [a for s in self.slots for a in caches[s].state]
        result = self._compiled(x, *state)
        outputs = len(result) - len(state)
        for i, s in enumerate(self.slots):
            caches[s].state = list(result[outputs + 2 * i : outputs + 2 * i + 2])
        return result[:outputs]


class _Attention:
    """One Nemotron-H attention block of ``B`` streams: its norm and q/k/v projections
    (compiled) and its output projection and residual (compiled) take every row at
    once; only the core (cache update and SDPA) runs per stream, on that stream's
    own cache object at its own offset. The block's own modules do the arithmetic,
    in its order, so a row equals the block run on that row alone."""

    def __init__(self, layer: Any, slot: int, attention: ArenaAttention):
        self.layer, self.slot = layer, slot
        self.attention = attention
        self._pre = mx.compile(self._project)
        self._post = mx.compile(self._output)

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        attn = self.layer.mixer
        h = self.layer.norm(x)
        q, k, v = project(attn, "fused_qkv", (attn.q_proj, attn.k_proj, attn.v_proj), h)
        heads = (attn.num_heads, attn.num_key_value_heads, attn.num_key_value_heads)
        if h.ndim == 2:  # one position's rows: [b, heads, 1, d] is one reshape
            return tuple(a.reshape(h.shape[0], n, 1, -1) for a, n in zip((q, k, v), heads))
        b, length, _ = h.shape
        return tuple(a.reshape(b, length, n, -1).transpose(0, 2, 1, 3)
                     for a, n in zip((q, k, v), heads))

    def _output(self, x: mx.array, out: mx.array) -> mx.array:
        b, _, length, _ = out.shape
        if x.ndim == 2:  # rows of one position: [b, heads, 1, d] in the rows' order
            return x + self.layer.mixer.o_proj(out.reshape(b, -1))
        return x + self.layer.mixer.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    def __call__(self, x: mx.array, layers: Sequence[Any], memo: StepArrays) -> mx.array:
        q, k, v = self._pre(x)
        scale = self.layer.mixer.scale
        held = layers[self.slot]  # one stream's cache, a batch's list of them, or its arena
        caches = held if isinstance(held, list) else [held]

        def one(cache: Any, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
            keys, values = cache.update_and_fetch(k, v)
            return scaled_dot_product_attention(q, keys, values, cache=cache, scale=scale,
                                                mask=None)

        def alone() -> mx.array:  # a cache a row: one stream's row slices and stacks as itself
            return stack_rows([one(cache, q[b : b + 1], k[b : b + 1], v[b : b + 1])
                               for b, cache in enumerate(caches)])

        return self._post(x, self.attention(q, k, v, held, scale, alone, memo))


class SegmentedStep:
    """One-position decode of a Nemotron-H stack (``layers`` with ``block_type``).

    ``head`` maps the last hidden state to the step's outputs (e.g. final norm
    and the two token heads). Use :meth:`ready` to decide per step: compiled
    runs need every Mamba state to exist (after the first step); the input
    is one position.
    """

    def __init__(self, layers: Sequence[Any], head: Callable[[mx.array], Sequence[mx.array]],
                 attention: ArenaAttention | None = None):
        self.attention = ArenaAttention() if attention is None else attention
        self.plan: list[Any] = []  # _Run or _Attention
        run: list[Any] = []
        run_slots: list[int | None] = []
        slot = 0
        for layer in layers:
            if layer.block_type == ATTENTION:
                if run:
                    self.plan.append(_Run(run, run_slots, None))
                    run, run_slots = [], []
                self.plan.append(_Attention(layer, slot, self.attention))
            else:
                run.append(layer)
                run_slots.append(slot if layer.block_type == MAMBA else None)
            slot += layer.block_type in (ATTENTION, MAMBA)
        self.plan.append(_Run(run, run_slots, head))
        # One position's hidden states travel as (B, hidden) rows where every layer
        # takes them (MambaStep, MLP and attention blocks): no product flattens its
        # input and unflattens its output. Upstream's Mamba2 block (Metal) or other
        # mixers take (B, 1, hidden).
        self.rows = all(
            part.steps[i] is not None if slot is not None else part.layers[i].block_type == "-"
            for part in self.plan if isinstance(part, _Run)
            for i, slot in enumerate(part.cache_index))
        self._mamba_slots = [s for part in self.plan if isinstance(part, _Run) for s in part.slots]

    def ready(self, caches: list[Any]) -> bool:
        return all(caches[s][0] is not None and caches[s][1] is not None
                   and caches[s].make_mask(1) is None for s in self._mamba_slots)

    def __call__(self, x: mx.array, caches: Sequence[Any]) -> tuple[mx.array, ...]:
        """One position of ``B`` streams (``x``: ``(B, 1, H)``) over ``caches``, one entry
        per layer: a Mamba2 slot's ``ArraysCache`` holds every row's states stacked
        (``[B, ...]``), an attention slot is the list of the rows' own KV caches (one
        stream: its cache).

        The attention-free runs (Mamba2, MLP, head) take all rows at once; an
        attention layer takes all rows through its projections and runs only
        its core per row, against that row's own KV cache, since the streams
        sit at different positions (rows are never padded to a common length,
        so each row's attention is its stream's own). Every stream must be
        :meth:`ready`; one stream is the ``B = 1`` case.
        """
        if self.rows:
            x = x.reshape(x.shape[0], x.shape[-1])
        memo: StepArrays = {}  # this step's ring write indices and masks, shared by its layers
        for part in self.plan:
            if isinstance(part, _Run):
                x = part(x, caches)
                if part.head is None:
                    x = x[0]
            else:
                x = part(x, caches, memo)
        return x

