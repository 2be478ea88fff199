"""Decode steps of layer stacks with their fixed-shape runs compiled.

On a one-position step most of a stack has inputs and state of constant shape:
Nemotron-H's Mamba2 layers (conv and SSM state), its MLP layers, and the
final norm and heads. Only attention, whose KV cache grows, changes shape
every step. :class:`SegmentedStep` splits a Nemotron-H stack at its attention layers and
runs each attention-free run of layers as one ``mx.compile``'d pure function
of ``(x, *state) -> (x, *state)``, so MLX traces it once and fuses its
elementwise work; attention layers run as usual between them. The layers'
own ``__call__`` does the arithmetic, so the outputs are the uncompiled
step's. :class:`GemmaStep` does the same for a Gemma-3 stack, whose every
layer attends: it compiles the spans between the attention cores. On CPU, where per-op dispatch dominates small frames, this is the
largest saving of the frame. Both run one position of many independent
streams (each with its own caches, at its own offset): the compiled spans
once over all their rows, the attention cores per stream; one stream is the
case of one row.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_vlm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_vlm.models.cache import ArraysCache
from mlx_vlm.models.gemma3.language import RMSNorm as GemmaRMSNorm
from mlx_vlm.models.gemma3.language import clip_residual

from . import fast_forms
from .fast_forms import RopeForm, rms_norm
from .fused import gated_mlp, project
from .kv_arena import LayerCores
from .mamba_step import MambaStep, use_upstream
from .rows import RowArraysCache, SharedRows, shared_arrays, stack_rows, take_row

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
        k = 0
        for layer, slot, step in zip(self.layers, self.cache_index, self.steps):
            if slot is None:
                x = layer(x)
                continue
            if step is not None:
                x, conv, ssm = step(x, state[k], state[k + 1])
                k += 2
                new_state += [conv, ssm]
                continue
            cache = ArraysCache(size=2)
            cache[0], cache[1] = state[k], state[k + 1]
            k += 2
            x = layer(x, mask=None, cache=cache)
            new_state += [cache[0], cache[1]]
        outputs = (x,) if self.head is None else tuple(self.head(x))
        return (*outputs, *new_state)

    def __call__(self, x: mx.array, rows: Sequence[list[Any]]) -> tuple[mx.array, ...]:
        """Row ``b`` of ``x`` with the Mamba2 states of ``rows[b]``: one call for all rows.

        The rows' states (batch 1 each) are stacked along the batch axis for
        the run and each row's slice is written back into its own cache after
        it; every op of the run is row-independent, so a row equals its own
        step. One row stacks and slices nothing (MLX returns the array itself).
        """
        slots = self.slots
        state: list[mx.array] = []
        for s in slots:
            caches = [r[s] for r in rows]
            # Rows the previous step handed back, in the same order, are its arrays
            # (no slice, no concatenation per step).
            shared = shared_arrays(caches)
            state += shared if shared is not None else [
                stack_rows([c.state[j] for c in caches]) for j in (0, 1)]
        result = self._compiled(x, *state)
        outputs = len(result) - len(state)
        for i, s in enumerate(slots):
            arrays = SharedRows(result[outputs + 2 * i : outputs + 2 * i + 2], len(rows))
            for b, caches in enumerate(rows):
                cache = caches[s]
                if isinstance(cache, RowArraysCache):
                    cache.share(arrays, b)
                else:
                    cache.state = [take_row(a, b) for a in arrays.arrays]
        return result[:outputs]


class _Attention:
    """One Nemotron-H attention block of ``B`` streams: its norm and q/k/v projections
    (compiled) and its output projection and residual (compiled) take every row at
    once; only the core (cache update and SDPA) runs per stream, on that stream's
    own cache object at its own offset. The block's own modules do the arithmetic,
    in its order, so a row equals the block run on that row alone."""

    def __init__(self, layer: Any, slot: int):
        self.layer, self.slot = layer, slot
        self.cores = LayerCores()
        self._pre = mx.compile(self._project)
        self._post = mx.compile(self._output)

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        attn = self.layer.mixer
        h = self.layer.norm(x)
        b, length, _ = h.shape
        q, k, v = project(attn, "fused_qkv", (attn.q_proj, attn.k_proj, attn.v_proj), h)
        q = q.reshape(b, length, attn.num_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(b, length, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(b, length, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        return q, k, v

    def _output(self, x: mx.array, out: mx.array) -> mx.array:
        b, _, length, _ = out.shape
        return x + self.layer.mixer.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    def __call__(self, x: mx.array, rows: Sequence[list[Any]]) -> mx.array:
        q, k, v = self._pre(x)
        scale = self.layer.mixer.scale
        caches = [r[self.slot] for r in rows]

        def alone() -> mx.array:
            outs = []
            for b, cache in enumerate(caches):
                keys, values = cache.update_and_fetch(k[b : b + 1], v[b : b + 1])
                outs.append(scaled_dot_product_attention(q[b : b + 1], keys, values, cache=cache,
                                                         scale=scale, mask=None))
            return stack_rows(outs)

        return self._post(x, self.cores(q, k, v, caches, 1, scale, alone))


class SegmentedStep:
    """One-position decode of a Nemotron-H stack (``layers`` with ``block_type``).

    ``head`` maps the last hidden state to the step's outputs (e.g. final norm
    and the two token heads). Use :meth:`ready` to decide per step: compiled
    runs need every Mamba state to exist (after the first step) and a
    single-position input.
    """

    def __init__(self, layers: Sequence[Any], head: Callable[[mx.array], Sequence[mx.array]]):
        self.plan: list[Any] = []  # _Run or _Attention
        run: list[Any] = []
        run_slots: list[int | None] = []
        slot = 0
        for layer in layers:
            kind = layer.block_type
            if kind == ATTENTION:
                if run:
                    self.plan.append(_Run(run, run_slots, None))
                    run, run_slots = [], []
                self.plan.append(_Attention(layer, slot))
                slot += 1
            elif kind == MAMBA:
                run.append(layer)
                run_slots.append(slot)
                slot += 1
            else:
                run.append(layer)
                run_slots.append(None)
        self.plan.append(_Run(run, run_slots, head))
        self.head = head
        self._mamba_slots = [s for part in self.plan if isinstance(part, _Run) for s in part.slots]

    def ready(self, x: mx.array, caches: list[Any]) -> bool:
        return x.shape[1] == 1 and all(
            _filled(caches[s]) and caches[s].make_mask(1) is None
            for s in self._mamba_slots
        )

    def __call__(self, x: mx.array, rows: Sequence[list[Any]]) -> tuple[mx.array, ...]:
        """One position of ``B`` streams: row ``b`` of ``x`` (``(B, 1, H)``) reads ``rows[b]``.

        The attention-free runs (Mamba2, MLP, head) take all rows at once; an
        attention layer takes all rows through its projections and runs only
        its core per row, against that row's own KV cache, since the streams
        sit at different positions (rows are never padded to a common length,
        so each row's attention is its stream's own). Every stream must be
        :meth:`ready`; one stream is the ``B = 1`` case.
        """
        for part in self.plan:
            if isinstance(part, _Run):
                x = part(x, rows)
                if part.head is None:
                    x = x[0]
            else:
                x = part(x, rows)
        return x


class GemmaStep:
    """One-position decode of a Gemma-3 stack, compiled between the attention cores.

    A Gemma-3 block is ``pre`` (input norm, q/k/v projections, q/k norms,
    RoPE at the cache offset), the attention core (cache update, SDPA) and
    ``post`` (output projection, sandwich norms, MLP, residuals). Only the core
    sees the growing cache; ``entry + pre(0)``, each ``post(i) + pre(i + 1)``
    and ``post(last) + final norm`` are fixed-shape and compiled (the RoPE
    offset enters as an array, which rotates exactly as the integer does).
    ``entry`` maps the step's inputs to the stack's input embedding.

    Where ``mx.fast`` ops expand into their fallback graphs (the CPU,
    :func:`~.fast_forms.fast_ops_expand`), the spans take each RoPE's tables
    (computed once per step, not per q and k of every layer) and its q/k
    norm weights per head instead of the offset, and norm and rotate q and k
    as one (:mod:`.fast_forms`: the fallbacks' own arithmetic, bit for bit).
    Elsewhere each layer's own norms and ``mx.fast.rope`` run, one kernel each.
    """

    def __init__(self, model: Any, entry: Callable[..., mx.array]):
        self.model = model
        self.layers = model.layers
        self.entry = entry
        last = len(self.layers) - 1
        self._forms = self._rope_forms()
        if self._forms is not None:
            ropes = list(dict.fromkeys(self._forms))  # the distinct RoPEs (local, global)
            self._table_of = [ropes.index(f) for f in self._forms]
            self._angles = mx.compile(
                lambda offset: tuple(t for rope in ropes for t in rope.angles(offset)))
            self._qk_weights: list[tuple[mx.array, ...] | None] = [None] * len(self.layers)
        self._enter = mx.compile(lambda rope, *inputs: self._pre(0, entry(*inputs), rope))
        self._between = [
            mx.compile(lambda x, out, rope, i=i: self._pre(i + 1, self._post(i, x, out), rope))
            for i in range(last)
        ]
        self._exit = mx.compile(lambda x, out: model.norm(self._post(last, x, out)))
        self._cores = [LayerCores() for _ in self.layers]

    def _rope_forms(self) -> list[RopeForm] | None:
        """Each layer's RoPE as shared tables and a rotation (:mod:`.fast_forms`), where
        ``mx.fast`` ops expand into their fallbacks and every layer's RoPE has a form;
        ``None`` (each layer's own ``rope`` at the offset) otherwise."""
        if not fast_forms.fast_ops_expand():
            return None
        forms = [RopeForm.of(layer.self_attn.rope) for layer in self.layers]
        return None if any(f is None for f in forms) else forms

    def _rope_inputs(self, rows: Sequence[list[Any]], group: int) -> Callable[[int], tuple]:
        """Layer ``i``'s RoPE input to its span: the offset per row, or with the forms,
        that layer's RoPE tables at those offsets, computed once per distinct offsets
        (every layer's, in a stack whose caches advance together), and its q/k norm
        weights per head (:meth:`_qk_weight`)."""

        def offset(i: int) -> mx.array:
            return mx.array([c[i].offset for c in rows] * group, dtype=mx.int32)

        if self._forms is None:
            return lambda i: (offset(i),)
        tables: dict[tuple[int, ...], tuple[mx.array, ...]] = {}

        def rope(i: int) -> tuple:
            key = tuple(c[i].offset for c in rows)
            if key not in tables:
                tables[key] = self._angles(offset(i))
            t = self._table_of[i]
            return (*tables[key][2 * t : 2 * t + 2], *self._qk_weight(i))

        return rope

    def _pre(self, i: int, x: mx.array, rope: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        attn = self.layers[i].self_attn
        x = clip_residual(x)
        h = self.layers[i].input_layernorm(x)
        if self._forms is not None:
            return (x, *self._rotated(i, attn, h, *rope))
        b, length, _ = h.shape
        q, k, v = project(attn, "fused_qkv", (attn.q_proj, attn.k_proj, attn.v_proj), h)
        q = q.reshape(b, length, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(b, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(b, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        (offset,) = rope
        q = attn.rope(attn.q_norm(q), offset=offset)
        k = attn.rope(attn.k_norm(k), offset=offset)
        return x, q, k, v

    def _qk_weight(self, i: int) -> tuple[mx.array, ...]:
        """Layer ``i``'s norm weights over its ``[q; k]`` heads (``[heads, 1, head_dim]``,
        Gemma's ``1 + w``: q_norm's on q heads, k_norm's on k heads), made once and
        again only when a norm's weight is replaced; ``()`` where the norms are not
        Gemma-3's. An input to the span rather than work in it."""
        attn = self.layers[i].self_attn
        if not _gemma_norms(attn):
            return ()
        wq, wk = attn.q_norm.weight, attn.k_norm.weight
        held = self._qk_weights[i]
        if held is None or held[0] is not wq or held[1] is not wk:
            weight = mx.concatenate([
                mx.broadcast_to(1.0 + wq, (attn.n_heads, wq.shape[-1])),
                mx.broadcast_to(1.0 + wk, (attn.n_kv_heads, wk.shape[-1])),
            ])[:, None]
            held = self._qk_weights[i] = (wq, wk, weight)
        return (held[2],)

    def _rotated(self, i: int, attn: Any, h: mx.array, cos: mx.array, sin: mx.array,
                 qk_weight: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """q, k (normed, rotated) and v of layer ``i`` with its RoPE's tables. Where q/k/v
        are one product, q's and k's heads are adjacent in it: one norm over both (each
        head with its own norm's weight) and one rotation, instead of two of each."""
        rope, b, length = self._forms[i], h.shape[0], h.shape[1]
        heads, kv_heads = attn.n_heads, attn.n_kv_heads
        fused = getattr(attn, "fused_qkv", None)
        if (qk_weight is not None and fused is not None
                and fused.serves((attn.q_proj, attn.k_proj, attn.v_proj))):
            qk, v = mx.split(fused.layer(h), [fused.splits[1]], axis=-1)
            qk = qk.reshape(b, length, heads + kv_heads, -1).transpose(0, 2, 1, 3)
            qk = rope(rms_norm(qk, qk_weight, attn.q_norm.eps), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q, k, v = project(attn, "fused_qkv", (attn.q_proj, attn.k_proj, attn.v_proj), h)
            q = q.reshape(b, length, heads, -1).transpose(0, 2, 1, 3)
            k = k.reshape(b, length, kv_heads, -1).transpose(0, 2, 1, 3)
            q = rope(attn.q_norm(q), cos, sin)
            k = rope(attn.k_norm(k), cos, sin)
        v = v.reshape(b, length, kv_heads, -1).transpose(0, 2, 1, 3)
        return q, k, v

    def _post(self, i: int, x: mx.array, out: mx.array) -> mx.array:
        layer = self.layers[i]
        b, _, length, _ = out.shape
        r = layer.self_attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))
        h = clip_residual(x + layer.post_attention_layernorm(r))
        r = gated_mlp(layer.mlp, layer.pre_feedforward_layernorm(h))
        return clip_residual(h + layer.post_feedforward_layernorm(r))

    @staticmethod
    def _core(attn: Any, q: mx.array, k: mx.array, v: mx.array, cache: Any) -> mx.array:
        k, v = cache.update_and_fetch(k, v)
        return scaled_dot_product_attention(q, k, v, cache, scale=attn.scale, mask=None)

    def ready(self, x: mx.array, caches: list[Any]) -> bool:
        """Single position, and the stack's own masks would be ``None``."""
        model = self.model
        pattern = model.sliding_window_pattern
        return (
            x.shape[1] == 1
            and create_attention_mask(x, caches[pattern - 1]) is None
            and (
                pattern == 1
                or create_attention_mask(x, caches[0], window_size=model.window_size) is None
            )
        )

    def __call__(self, rows: Sequence[list[Any]], group: int, *inputs: mx.array) -> mx.array:
        """One position of ``S = len(rows)`` independent streams in one batch.

        Stream ``s`` owns the rows ``s, s + S, ..., s + (group - 1) S`` of the
        batch (e.g. ``[cond; uncond]`` with ``group=2``), and its own caches
        ``rows[s]``, which may sit at any offset. The fixed-shape spans run
        once over all rows (RoPE with one offset per row); the attention core
        runs per stream on its rows and its own cache objects, never a padded
        common cache. Every stream's rows are bit-identical to the stream run
        alone, and its caches end in the same state, provided the spans'
        row-wise ops are (they are on MLX's CPU backend: matmuls, norms,
        elementwise). Each stream must be :meth:`ready`; one stream is the
        ``S = 1`` case.
        """

        rope = self._rope_inputs(rows, group)
        x, q, k, v = self._enter(rope(0), *inputs)
        for i, layer in enumerate(self.layers):
            caches = [c[i] for c in rows]
            out = self._cores[i](q, k, v, caches, group, layer.self_attn.scale,
                                 lambda: self._stream_cores(layer.self_attn, q, k, v, caches))
            if i + 1 < len(self.layers):
                x, q, k, v = self._between[i](x, out, rope(i + 1))
            else:
                return self._exit(x, out)
        raise ValueError("empty Gemma-3 stack")

    def _stream_cores(
        self, attn: Any, q: mx.array, k: mx.array, v: mx.array, caches: list[Any]
    ) -> mx.array:
        """The attention core of each stream on its strided rows, re-interleaved."""
        streams = len(caches)
        outs = [
            self._core(attn, q[s::streams], k[s::streams], v[s::streams], cache)[:, None]
            for s, cache in enumerate(caches)
        ]
        # outs[s] is [group, 1, ...]: row j of stream s goes back to row j * S + s.
        joined = mx.concatenate(outs, axis=1)
        return joined.reshape(-1, *joined.shape[2:])


def _filled(cache: Any) -> bool:
    """A Mamba2 cache holds both of its states (a shared row checked without slicing)."""
    if isinstance(cache, RowArraysCache):
        return cache.filled()
    return cache[0] is not None and cache[1] is not None


def _gemma_norms(attn: Any) -> bool:
    """q and k normed by Gemma-3 RMSNorms (weight ``1 + w``) with one epsilon and one
    weight dtype (a stack of two dtypes would promote one of them)."""
    return (type(attn.q_norm) is GemmaRMSNorm and type(attn.k_norm) is GemmaRMSNorm
            and attn.q_norm.eps == attn.k_norm.eps
            and attn.q_norm.weight.dtype == attn.k_norm.weight.dtype)
