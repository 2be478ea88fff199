"""One-position decode of a Gemma-3 stack (the EAR-TTS backbone), compiled between the cores.

Every layer of a Gemma-3 stack attends, so :class:`GemmaStep` compiles the
fixed-shape spans between the attention cores (:mod:`.segments` does the
same for Nemotron-H's attention-free runs), for many independent streams at
once, each with its own caches at its own offset; one stream is the case of
one row.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_vlm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_vlm.models.gemma3.language import RMSNorm as GemmaRMSNorm
from mlx_vlm.models.gemma3.language import clip_residual

from .. import fast_forms
from ..fast_forms import RopeForm, rms_norm
from ..fused import gated_mlp, project
from ..kv_arena import ArenaAttention, StepArrays, ring_offsets


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

    def __init__(self, model: Any, entry: Callable[..., mx.array],
                 attention: ArenaAttention | None = None):
        self.model = model
        self.attention = ArenaAttention() if attention is None else attention
        self.layers = model.layers
        last = len(self.layers) - 1
        self._forms = self._rope_forms()
        if self._forms is not None:
            ropes = list(dict.fromkeys(self._forms))  # the distinct RoPEs (local, global)
            self._table_of = [ropes.index(f) for f in self._forms]
            self._angles = mx.compile(
                lambda offset: tuple(t for rope in ropes for t in rope.angles(offset)))
            self._qk_weights: list[tuple[mx.array, ...] | None] = [None] * len(self.layers)
        # The spans carry one position's [b, width] rows: no product flattens its input
        # and unflattens its output, and heads are one reshape (with one position,
        # [b, 1, heads, d] transposed is [b, heads, 1, d] in the same order).
        self._enter = mx.compile(
            lambda rope, *inputs: self._pre(0, entry(*inputs).flatten(0, 1), rope))
        self._between = [
            mx.compile(lambda x, out, rope, i=i: self._pre(i + 1, self._post(i, x, out), rope))
            for i in range(last)
        ]
        self._exit = mx.compile(lambda x, out: model.norm(self._post(last, x, out))[:, None])

    def _rope_forms(self) -> list[RopeForm] | None:
        """Each layer's RoPE as shared tables and a rotation (:mod:`.fast_forms`), where
        ``mx.fast`` ops expand into their fallbacks and every layer's RoPE has a form;
        ``None`` (each layer's own ``rope`` at the offset) otherwise."""
        if not fast_forms.fast_ops_expand():
            return None
        forms = [RopeForm.of(layer.self_attn.rope) for layer in self.layers]
        return None if any(f is None for f in forms) else forms

    def _rope_inputs(self, layers: Sequence[Any], group: int) -> Callable[[int], tuple]:
        """Layer ``i``'s RoPE input to its span: the offset per row, or with the forms,
        that layer's RoPE tables at those offsets, computed once per distinct offsets
        (every layer's, in a stack whose caches advance together), and its q/k norm
        weights per head (:meth:`_qk_weight`)."""

        def offset(key: tuple[int, ...]) -> mx.array:
            return mx.array(list(key) * group, dtype=mx.int32)

        if self._forms is None:
            return lambda i: (offset(ring_offsets(layers[i])),)
        tables: dict[tuple[int, ...], tuple[mx.array, ...]] = {}

        def rope(i: int) -> tuple:
            key = ring_offsets(layers[i])
            if key not in tables:
                tables[key] = self._angles(offset(key))
            t = self._table_of[i]
            return (*tables[key][2 * t : 2 * t + 2], *self._qk_weight(i))

        return rope

    def _pre(self, i: int, x: mx.array, rope: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        attn = self.layers[i].self_attn
        x = clip_residual(x)
        h = self.layers[i].input_layernorm(x)
        if self._forms is not None:
            return (x, *self._rotated(i, attn, h, *rope))
        (offset,) = rope
        return (x, *_qkv(attn, h, lambda t: attn.rope(t, offset=offset)))

    def _qk_weight(self, i: int) -> tuple[mx.array, ...]:
        """Layer ``i``'s norm weights over its ``[q; k]`` heads (``[heads, 1, head_dim]``,
        Gemma's ``1 + w``: q_norm's on q heads, k_norm's on k heads), made once and
        again only when a norm's weight is replaced; ``()`` where the norms are not
        Gemma-3's. An input to the span rather than work in it."""
        attn = self.layers[i].self_attn
        # Gemma-3 RMSNorms (weight 1 + w) with one epsilon and one weight dtype (a stack
        # of two dtypes would promote one of them).
        if not (type(attn.q_norm) is GemmaRMSNorm is type(attn.k_norm)
                and attn.q_norm.eps == attn.k_norm.eps
                and attn.q_norm.weight.dtype == attn.k_norm.weight.dtype):
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
        rope = self._forms[i]
        heads, kv_heads = attn.n_heads, attn.n_kv_heads
        fused = getattr(attn, "fused_qkv", None)
        if (qk_weight is not None and fused is not None
                and fused.serves((attn.q_proj, attn.k_proj, attn.v_proj))):
            qk, v = mx.split(fused.layer(h), [fused.splits[1]], axis=-1)
            qk = _heads(qk, heads + kv_heads)
            qk = rope(rms_norm(qk, qk_weight, attn.q_norm.eps), cos, sin)
            return qk[:, :heads], qk[:, heads:], _heads(v, kv_heads)
        return _qkv(attn, h, lambda t: rope(t, cos, sin))

    def _post(self, i: int, x: mx.array, out: mx.array) -> mx.array:
        layer = self.layers[i]
        # One position: [b, heads, 1, head_dim] in the order of the [b, width] rows.
        r = layer.self_attn.o_proj(out.reshape(out.shape[0], -1))
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

    def __call__(self, layers: Sequence[Any], group: int, *inputs: mx.array) -> mx.array:
        """One position of ``S`` independent streams in one batch.

        Stream ``s`` owns the rows ``s, s + S, ..., s + (group - 1) S`` of the
        batch (e.g. ``[cond; uncond]`` with ``group=2``), and its own caches,
        which may sit at any offset: ``layers[i]`` is layer ``i``'s, the list of
        every stream's cache or the :class:`~.kv_arena.KVArena` their batch stacked. The fixed-shape spans run
        once over all rows (RoPE with one offset per row); the attention core
        runs per stream on its rows and its own cache objects, never a padded
        common cache. Every stream's rows are bit-identical to the stream run
        alone, and its caches end in the same state, provided the spans'
        row-wise ops are (they are on MLX's CPU backend: matmuls, norms,
        elementwise). Each stream must be :meth:`ready`; one stream is the
        ``S = 1`` case.
        """

        rope = self._rope_inputs(layers, group)
        x, q, k, v = self._enter(rope(0), *inputs)
        memo: StepArrays = {}  # this step's ring write indices and masks, shared by its layers
        for i, layer in enumerate(self.layers):
            caches = layers[i]
            out = self.attention(q, k, v, caches, layer.self_attn.scale,
                             lambda: self._stream_cores(layer.self_attn, q, k, v, caches), memo)
            if i + 1 == len(self.layers):
                return self._exit(x, out)
            x, q, k, v = self._between[i](x, out, rope(i + 1))

    def _stream_cores(
        self, attn: Any, q: mx.array, k: mx.array, v: mx.array, caches: list[Any]
    ) -> mx.array:
        """The attention core of each stream on its strided rows, re-interleaved."""
        streams = len(caches)
        if streams == 1:  # one stream owns every row: no slices, nothing to re-interleave
            return self._core(attn, q, k, v, caches[0])
        outs = [
            self._core(attn, q[s::streams], k[s::streams], v[s::streams], cache)[:, None]
            for s, cache in enumerate(caches)
        ]
        # outs[s] is [group, 1, ...]: row j of stream s goes back to row j * S + s.
        joined = mx.concatenate(outs, axis=1)
        return joined.reshape(-1, *joined.shape[2:])


def _qkv(attn: Any, h: mx.array, rotate: Callable[[mx.array], mx.array]
         ) -> tuple[mx.array, mx.array, mx.array]:
    """q, k (each normed by its own norm, then rotated) and v of one position's rows."""
    q, k, v = project(attn, "fused_qkv", (attn.q_proj, attn.k_proj, attn.v_proj), h)
    q = rotate(attn.q_norm(_heads(q, attn.n_heads)))
    k = rotate(attn.k_norm(_heads(k, attn.n_kv_heads)))
    return q, k, _heads(v, attn.n_kv_heads)


def _heads(x: mx.array, heads: int) -> mx.array:
    """A projection's ``[b, heads * d]`` rows of one position as ``[b, heads, 1, d]``."""
    return x.reshape(x.shape[0], heads, 1, -1)
