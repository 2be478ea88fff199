"""Cache-aware FastConformer streaming, one chunk of mel frames at a time.

The causal 8x depthwise-striding subsampling streams (:meth:`EncoderStream.subsample`):
it keeps the last 16 mel frames (the stack's causal receptive field, kept
aligned to the 8-frame grid), reruns the stack over ``kept + new`` only, and
returns the encoder frames it has not returned yet, up to the input's right
edge. The conformer blocks then run on those frames with, per layer, the last
``left_context`` (70) attention inputs and the last ``kernel - 1`` (8)
depthwise-conv inputs. Work and memory per chunk are bounded by these
windows; once they are full, a one-frame chunk runs the whole stack as one
compiled graph.

State follows mlx-lm's cache convention: :class:`~.encoder_cache.EncoderCache`
holds ``B`` streams' windows and kept mel frames stacked, and their counters.
:class:`EncoderStream` is the computation, one per model, so its graphs
compile once: :meth:`EncoderStream.step` runs a chunk of a merged cache's
rows in place (its caller keeps the merged cache between chunks, merging
only caches of equal shapes: padding would change a row's reductions). One
stream is ``B = 1`` of the same code.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr.conformer import Conformer

from .encoder_cache import EncoderCache, SubsamplingTail
from ..fast_forms import attention_prescaled, fast_ops_expand

MEL_CONTEXT = 16  # >= causal receptive field of three stride-2, kernel-3 convs


def _attend_kv(attn: nn.Module, q_in: mx.array, k: mx.array, v: mx.array, p: mx.array,
               q: mx.array | None = None) -> mx.array:
    """mlx-audio's ``RelPositionMultiHeadAttention.stream`` with the keys and values (and
    maybe ``q``) already projected and ``p = linear_pos(pos_emb)`` given.

    The positional projection depends only on the window length, so the
    steady window's is computed once per layer instead of every frame.
    """
    if q is None:
        q = attn.linear_q(q_in)
    batch, c, _ = q.shape
    ksz = k.shape[1]

    def heads(t: mx.array) -> mx.array:  # [b, n, heads * d] -> [b, n, heads, d]
        return t.reshape(*t.shape[:2], attn.n_head, attn.head_dim)

    q = heads(q)
    # One query a row where mx.fast expands: the scaled dot product's first kernel (q
    # times the scale) runs inside the kernel that adds the position bias (fast_forms).
    prescaled = c == 1 and fast_ops_expand()
    q_u = q + attn.pos_bias_u
    q_u = (q_u * mx.array(attn.scale, q.dtype) if prescaled else q_u).transpose(0, 2, 1, 3)
    q_v = (q + attn.pos_bias_v).transpose(0, 2, 1, 3)
    k, v, p = (heads(t).transpose(0, 2, 1, 3) for t in (k, v, p))
    matrix_bd = mx.matmul(q_v, p.swapaxes(-2, -1))
    if c > 1:
        matrix_bd = attn.rel_shift(matrix_bd)
    # (One query: the relative shift pads a zero in front, reads the row one step
    # later and drops the zero, so its row comes back as it was: nothing to launch.)
    matrix_bd = matrix_bd[:, :, :, :ksz] * attn.scale
    o = (attention_prescaled(q_u, k, v, matrix_bd) if prescaled
         else mx.fast.scaled_dot_product_attention(q_u, k, v, scale=attn.scale, mask=matrix_bd))
    return attn.linear_out(o.transpose(0, 2, 1, 3).reshape(batch, c, -1))


def _project_qkv(attn: nn.Module, x: mx.array) -> tuple[mx.array | None, mx.array]:
    """The new frames' keys and values side by side (``[B, T, 2d]``, as the window caches
    them) and, when q/k/v are fused (:mod:`.fused`), their queries from the same
    product (else ``None``: :func:`_attend_kv` projects them)."""
    fused = getattr(attn, "fused_qkv", None)
    if fused is not None and fused.serves((attn.linear_q, attn.linear_k, attn.linear_v)):
        both = fused.layer(x)  # [q | k | v]: the k|v half is one slice, no concatenation
        return both[..., : fused.sizes[0]], both[..., fused.sizes[0] :]
    return None, mx.concatenate([attn.linear_k(x), attn.linear_v(x)], axis=-1)


class WindowPositions:
    """Each layer's projected positional embedding for the full attention window, once per model.

    ``pos_emb_for(L)`` is the centred ``2L - 1`` rows of one fixed table, so a
    shorter window's projection is the centre slice of the full window's
    (rows of a product are independent: the same assumption as ``cache_kv``).
    While the windows fill (the first ``left_context`` frames of a stream) a
    frame then slices instead of projecting ``2L - 1`` rows in every layer.
    """

    def __init__(self, encoder: Conformer, window: int, dtype: mx.Dtype,
                 full: list[mx.array] | None = None):
        """``full``: the projections as computed before for these weights (read back,
        :func:`~.remembered.load_arrays`), instead of computing them here."""
        self.window, self.dtype = window, dtype
        if full is None:
            table = encoder.pos_enc.pos_emb_for(window, dtype)
            full = [layer.self_attn.linear_pos(table) for layer in encoder.layers]
        self.full = full
        mx.eval(self.full)

    def covers(self, length: int, dtype: mx.Dtype) -> bool:
        return 0 < length <= self.window and dtype == self.dtype

    def for_length(self, index: int, length: int) -> mx.array:
        start = self.window - length
        return self.full[index][:, start : start + 2 * length - 1]


class EncoderStream:
    """The conformer stack one chunk at a time over streams' :class:`EncoderCache` s.

    ``cache_kv`` (default): a layer's attention cache holds the projected keys
    and values of its window (``[K | V]`` rows), so a frame projects only its
    new row; bit-identical to projecting the whole window on the CPU backend
    (``tests/test_compiled_steps.py``). ``cache_kv=False`` caches the
    attention inputs and projects the whole window every frame, as the
    reference does, for a backend whose matmul rounds a row differently
    inside a larger product.
    """

    def __init__(self, encoder: Conformer, left_context: int, cache_kv: bool = True,
                 positions: WindowPositions | None = None):
        self.encoder = encoder
        # Shared per model (``Perception.window_positions``); used only with
        # cache_kv, whose row-independence it relies on too.
        self.positions = positions
        self.left_context = left_context
        self.cache_kv = cache_kv
        self.conv_context = encoder.args.conv_kernel_size - 1
        self.factor = encoder.args.subsampling_factor
        self.layers = len(encoder.layers)
        # A handful of subsampling window widths occur (the start, then one
        # steady width); mx.compile traces each once.
        self._run_subsampling = mx.compile(self._subsampling)
        # Once every window is full a one-frame chunk has fixed shapes: the
        # whole stack runs as one compiled graph, with each layer's projected
        # positional embedding of the full window computed once.
        self._steady_pos: list[mx.array] | None = None
        self._steady = mx.compile(self._stack)
        self._enter_c = [mx.compile(partial(self._enter, i)) for i in range(self.layers)]
        self._leave_c = [mx.compile(partial(self._leave, i)) for i in range(self.layers)]

    def make_cache(self) -> EncoderCache:
        """A new stream's (empty) cache."""
        return EncoderCache(self.layers)

    # --- subsampling, per stream -------------------------------------------

    def _subsampling(self, window: mx.array) -> mx.array:
        pre_encode = self.encoder.pre_encode
        # The lengths as host ints: pre_encode reads each one back (``int``), which
        # for an array would be a host round trip per stream and frame uncompiled.
        return pre_encode(window, [window.shape[1]] * window.shape[0])[0]

    def subsample(self, cache: EncoderCache, mel: mx.array) -> mx.array:
        """``cache``'s ``B`` streams' ``(B, n, F)`` new mel frames -> their ``(B, k, D)`` new
        encoder-rate frames (lazy; ``cache.kept`` updated). The kept and new frames run
        the subsampling stack as one batch (its convolutions and projection are
        row-independent, like the encoder's blocks): rows of one :meth:`EncoderCache.key`
        keep as many frames and return the same window positions."""
        kept = cache.kept
        window = mel if kept is None else mx.concatenate([kept, mel], axis=1)
        out = self._run_subsampling(window)
        ran = {self._advance(t, mel.shape[1], window.shape[1], out.shape[1]) for t in cache.tails}
        if len(ran) != 1:
            raise ValueError(f"streams of one batch keep mel frames and return encoder frames "
                             f"{sorted(ran)} (kept, start, stop); a batch takes equal ones")
        keep, start, stop = ran.pop()
        cache.kept = window[:, -keep:]
        return out[:, start:stop] if stop > start else out[:, :0]

    def _advance(self, tail: SubsamplingTail, new: int, width: int, stop: int
                 ) -> tuple[int, int, int]:
        """A stream's counters after its window of ``width`` mel frames, ``new`` of them new,
        ran and gave ``stop`` output frames: how many mel frames it keeps, and which of
        the outputs (``start:stop``) it has not returned yet."""
        # Encoder frame index of the window's first output.
        first = (tail.consumed - (width - new)) // self.factor
        tail.consumed += new
        start = tail.emitted - first
        tail.emitted = first + max(start, stop)
        return MEL_CONTEXT + (tail.consumed - MEL_CONTEXT) % self.factor, start, stop

    # --- the conformer blocks, B rows ----------------------------------------

    def _pos(self, index: int, length: int, dtype: mx.Dtype) -> mx.array:
        if self.cache_kv and self.positions is not None and self.positions.covers(length, dtype):
            return self.positions.for_length(index, length)
        attn = self.encoder.layers[index].self_attn
        return attn.linear_pos(self.encoder.pos_enc.pos_emb_for(length, dtype))

    def _enter(self, index: int, x: mx.array) -> tuple[mx.array, mx.array]:
        """First feed-forward half of block ``index``; also returns the attention input."""
        block = self.encoder.layers[index]
        x = x + 0.5 * block.feed_forward1(block.norm_feed_forward1(x))
        return x, block.norm_self_att(x)

    def _leave(
        self, index: int, x: mx.array, attended: mx.array, previous: mx.array
    ) -> tuple[mx.array, mx.array]:
        """The rest of block ``index`` after attention; returns ``(x, conv cache)``."""
        block = self.encoder.layers[index]
        x = x + attended
        # Causal depthwise conv over the cached GLU outputs plus the new ones.
        conv = block.conv
        g = nn.glu(conv.pointwise_conv1(block.norm_conv(x)), axis=-1)
        window = mx.concatenate([previous.astype(g.dtype), g], axis=1)
        y = conv.pointwise_conv2(conv.activation(conv.batch_norm(conv.depthwise_conv(window))))
        x = x + y
        x = x + 0.5 * block.feed_forward2(block.norm_feed_forward2(x))
        return block.norm_out(x), window[:, -self.conv_context :]

    def _block(
        self, index: int, x: mx.array, cached: mx.array | None, previous: mx.array | None,
        pos: mx.array, compiled: bool = False,
    ) -> tuple[mx.array, mx.array, mx.array]:
        """One conformer block on new frames ``x``; returns ``(x, attention, conv)`` caches.

        ``compiled``: run the fixed-shape halves around attention compiled
        (while the windows fill, attention changes shape every frame).
        """
        if compiled:
            enter, leave = self._enter_c[index], self._leave_c[index]
        else:
            enter, leave = partial(self._enter, index), partial(self._leave, index)
        x, q = enter(x)
        attn = self.encoder.layers[index].self_attn
        # Queries are the new frames; keys/values the cached window plus them.
        if self.cache_kv:
            queries, new = _project_qkv(attn, q)
            kv = new if cached is None else mx.concatenate([cached, new], axis=1)
            width = new.shape[-1] // 2
            attended = _attend_kv(attn, q, kv[..., :width], kv[..., width:], pos, queries)
        else:
            kv = q if cached is None else mx.concatenate([cached, q], axis=1)
            attended = _attend_kv(attn, q, attn.linear_k(kv), attn.linear_v(kv), pos)
        attention = kv[:, -self.left_context :] if self.left_context else kv[:, :0]
        if previous is None:
            previous = mx.zeros((x.shape[0], self.conv_context, x.shape[2]), dtype=x.dtype)
        x, conv = leave(x, attended, previous)
        return x, attention, conv

    def _stack(self, x: mx.array, *state: mx.array) -> tuple[mx.array, ...]:
        layers = self.layers
        attention, conv, pos = state[:layers], state[layers : 2 * layers], state[2 * layers :]
        new_attention, new_conv = [], []
        for index in range(layers):
            x, a, c = self._block(index, x, attention[index], conv[index], pos[index])
            new_attention.append(a)
            new_conv.append(c)
        return (x, *new_attention, *new_conv)

    def _is_steady(self, cache: EncoderCache, x: mx.array) -> bool:
        full = self.left_context
        # (Every block writes its attention and conv windows together.)
        return x.shape[1] == 1 and full > 0 and all(
            a is not None and a.shape[1] == full for a in cache.attention)

    def __call__(self, cache: EncoderCache, x: mx.array) -> mx.array:
        """The conformer blocks on ``(B, n, d_model)`` new encoder-rate frames of ``cache``'s
        ``B`` streams (its windows are updated in place); ``(B, n, d_model)`` out."""
        if x.shape[1] == 0:
            return x
        layers = self.layers
        if self._is_steady(cache, x):
            if self._steady_pos is None:
                length = self.left_context + 1
                self._steady_pos = [self._pos(i, length, x.dtype) for i in range(layers)]
            out = self._steady(x, *cache.attention, *cache.conv, *self._steady_pos)
            cache.attention = list(out[1 : 1 + layers])
            cache.conv = list(out[1 + layers :])
            return out[0]
        for index in range(layers):
            cached = cache.attention[index]
            length = x.shape[1] + (0 if cached is None else cached.shape[1])
            x, cache.attention[index], cache.conv[index] = self._block(
                index, x, cached, cache.conv[index], self._pos(index, length, x.dtype),
                compiled=True,
            )
        return x

    def step(self, cache: EncoderCache, mel: mx.array) -> mx.array:
        """A chunk of ``cache``'s ``B`` streams (one :meth:`EncoderCache.key`): ``(B, n, F)``
        new mel frames -> the ``(B, k, d_model)`` encoded frames (lazy; ``cache`` updated
        in place). Full windows run the compiled stack, filling ones the per-layer
        blocks; every row equals its stream run alone."""
        return self(cache, self.subsample(cache, mel))
