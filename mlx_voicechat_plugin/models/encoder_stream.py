"""Cache-aware FastConformer streaming, one chunk of mel frames at a time.

:class:`SubsamplingStream` is the causal 8x depthwise-striding subsampling as a
drop-in streaming module: it keeps the last 16 mel frames (the stack's causal
receptive field, kept aligned to the 8-frame grid), reruns the stack over
``cache + new`` only, and returns the encoder frames it has not returned yet,
up to the input's right edge. :class:`EncoderStream` runs the conformer blocks
on those frames with, per layer, the last ``left_context`` (70) attention
inputs and the last ``kernel - 1`` (8) depthwise-conv inputs. Work and memory
per chunk are bounded by these windows; once they are full, a one-frame chunk
runs the whole stack as one compiled graph.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr.conformer import Conformer

MEL_CONTEXT = 16  # >= causal receptive field of three stride-2, kernel-3 convs


class SubsamplingStream:
    def __init__(self, pre_encode: nn.Module, factor: int):
        self.pre_encode = pre_encode
        self.factor = factor
        self.cache: mx.array | None = None
        self.consumed = 0  # mel frames pushed so far
        self.emitted = 0  # encoder frames returned so far
        # A handful of window widths occur (the start, then one steady width);
        # mx.compile traces each once.
        self._run = mx.compile(self._subsample)

    def _subsample(self, window: mx.array) -> mx.array:
        return self.pre_encode(window, mx.array([window.shape[1]], dtype=mx.int32))[0]

    def push(self, mel: mx.array) -> mx.array:
        """``(1, n, F)`` new mel frames -> ``(1, k, D)`` new encoder-rate frames."""
        cached = 0 if self.cache is None else self.cache.shape[1]
        window = mel if self.cache is None else mx.concatenate([self.cache, mel], axis=1)
        frames = self._run(window)
        # Encoder frame index of the window's first output.
        first = (self.consumed - cached) // self.factor
        self.consumed += mel.shape[1]
        keep = MEL_CONTEXT + (self.consumed - MEL_CONTEXT) % self.factor
        self.cache = window[:, -keep:]
        start = self.emitted - first
        stop = frames.shape[1]
        self.emitted = first + max(start, stop)
        return frames[:, start:stop] if stop > start else frames[:, :0]


def _attend(attn: nn.Module, q_in: mx.array, kv_in: mx.array, p: mx.array) -> mx.array:
    """mlx-audio's ``RelPositionMultiHeadAttention.stream`` with ``p = linear_pos(pos_emb)`` given.

    The positional projection depends only on the window length, so the
    steady window's is computed once per layer instead of every frame.
    """
    return _attend_kv(attn, q_in, attn.linear_k(kv_in), attn.linear_v(kv_in), p)


def _attend_kv(attn: nn.Module, q_in: mx.array, k: mx.array, v: mx.array, p: mx.array) -> mx.array:
    """:func:`_attend` with the keys and values already projected (``[B, T, d]`` each)."""
    q = attn.linear_q(q_in)
    batch, c, _ = q.shape
    ksz = k.shape[1]
    pos_len = p.shape[1]
    q = q.reshape(batch, c, attn.n_head, attn.head_dim)
    q_u = (q + attn.pos_bias_u).transpose(0, 2, 1, 3)
    q_v = (q + attn.pos_bias_v).transpose(0, 2, 1, 3)
    k = k.reshape(batch, ksz, attn.n_head, attn.head_dim).transpose(0, 2, 1, 3)
    v = v.reshape(batch, ksz, attn.n_head, attn.head_dim).transpose(0, 2, 1, 3)
    p = p.reshape(1, pos_len, attn.n_head, attn.head_dim).transpose(0, 2, 1, 3)
    matrix_bd = mx.matmul(q_v, p.swapaxes(-2, -1))
    matrix_bd = attn.rel_shift(matrix_bd)[:, :, :, :ksz] * attn.scale
    o = mx.fast.scaled_dot_product_attention(q_u, k, v, scale=attn.scale, mask=matrix_bd)
    return attn.linear_out(o.transpose(0, 2, 1, 3).reshape(batch, c, -1))


class WindowPositions:
    """Each layer's projected positional embedding for the full attention window, once per model.

    ``pos_emb_for(L)`` is the centred ``2L - 1`` rows of one fixed table, so a
    shorter window's projection is the centre slice of the full window's
    (rows of a product are independent: the same assumption as ``cache_kv``).
    While the windows fill (the first ``left_context`` frames of a stream) a
    frame then slices instead of projecting ``2L - 1`` rows in every layer.
    """

    def __init__(self, encoder: Conformer, window: int, dtype: mx.Dtype):
        self.window, self.dtype = window, dtype
        table = encoder.pos_enc.pos_emb_for(window, dtype)
        self.full = [layer.self_attn.linear_pos(table) for layer in encoder.layers]
        mx.eval(self.full)

    def covers(self, length: int, dtype: mx.Dtype) -> bool:
        return 0 < length <= self.window and dtype == self.dtype

    def for_length(self, index: int, length: int) -> mx.array:
        start = self.window - length
        return self.full[index][:, start : start + 2 * length - 1]


class EncoderStream:
    """The conformer stack one chunk at a time, from per-layer caches.

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
        self.subsampling = SubsamplingStream(encoder.pre_encode, encoder.args.subsampling_factor)
        layers = len(encoder.layers)
        self.attention: list[mx.array | None] = [None] * layers
        self.conv: list[mx.array | None] = [None] * layers
        # Once every window is full a one-frame chunk has fixed shapes: the
        # whole stack runs as one compiled graph, with each layer's projected
        # positional embedding of the full window computed once.
        self._steady_pos: list[mx.array] | None = None
        self._steady = mx.compile(self._stack)
        self._enter_c = [mx.compile(partial(self._enter, i)) for i in range(layers)]
        self._leave_c = [mx.compile(partial(self._leave, i)) for i in range(layers)]

    @property
    def state(self) -> list[mx.array]:
        """The carried caches (attention rows, conv contexts, subsampling tail)."""
        arrays = [a for a in (*self.attention, *self.conv) if a is not None]
        if self.subsampling.cache is not None:
            arrays.append(self.subsampling.cache)
        return arrays

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
            new = mx.concatenate([attn.linear_k(q), attn.linear_v(q)], axis=-1)
            kv = new if cached is None else mx.concatenate([cached, new], axis=1)
            width = new.shape[-1] // 2
            attended = _attend_kv(attn, q, kv[..., :width], kv[..., width:], pos)
        else:
            kv = q if cached is None else mx.concatenate([cached, q], axis=1)
            attended = _attend(attn, q, kv, pos)
        attention = kv[:, -self.left_context :] if self.left_context else kv[:, :0]
        if previous is None:
            previous = mx.zeros((x.shape[0], self.conv_context, x.shape[2]), dtype=x.dtype)
        x, conv = leave(x, attended, previous)
        return x, attention, conv

    def _stack(self, x: mx.array, *state: mx.array) -> tuple[mx.array, ...]:
        layers = len(self.encoder.layers)
        attention, conv, pos = state[:layers], state[layers : 2 * layers], state[2 * layers :]
        new_attention, new_conv = [], []
        for index in range(layers):
            x, a, c = self._block(index, x, attention[index], conv[index], pos[index])
            new_attention.append(a)
            new_conv.append(c)
        return (x, *new_attention, *new_conv)

    def _is_steady(self, x: mx.array) -> bool:
        full = self.left_context
        return x.shape[1] == 1 and full > 0 and all(
            a is not None and a.shape[1] == full for a in self.attention
        ) and all(c is not None for c in self.conv)

    def push(self, mel: mx.array) -> mx.array:
        """``(1, n, F)`` mel -> ``(1, k, d_model)`` newly encoded frames."""
        return self._encode(self.subsampling.push(mel))

    def _steady_positions(self, dtype: mx.Dtype) -> list[mx.array]:
        if self._steady_pos is None:
            length = self.left_context + 1
            self._steady_pos = [self._pos(i, length, dtype) for i in range(len(self.encoder.layers))]
        return self._steady_pos

    @staticmethod
    def push_batch(streams: list["EncoderStream"], mels: list[mx.array]) -> list[mx.array]:
        """:meth:`push` of many streams of one encoder; each result equals its own ``push``.

        Streams whose caches have the same shapes (:meth:`_shape_key`) run as
        one batch, so each row's attention spans its own window of the same
        length: those with full windows run the compiled stack, those still
        filling theirs (streams that started on the same frame) the per-layer
        blocks. A stream that shares its shapes with no other runs alone.
        """
        xs = [s.subsampling.push(mel) for s, mel in zip(streams, mels)]
        groups: dict[tuple, list[int]] = {}
        for b, (stream, x) in enumerate(zip(streams, xs)):
            groups.setdefault(stream._shape_key(x), []).append(b)
        out: list[mx.array | None] = [None] * len(streams)
        for rows in groups.values():
            if len(rows) == 1 or xs[rows[0]].shape[1] == 0:
                for b in rows:
                    out[b] = streams[b]._encode(xs[b])
                continue
            group = [streams[b] for b in rows]
            encoded = EncoderStream._encode_rows(group, mx.concatenate([xs[b] for b in rows]))
            for j, b in enumerate(rows):
                out[b] = encoded[j : j + 1]
        return out  # type: ignore[return-value]

    def _shape_key(self, x: mx.array) -> tuple:
        """What must be equal for streams to share a batch: new frames and cache lengths."""
        return (x.shape[1], tuple(None if a is None else a.shape[1] for a in self.attention),
                tuple(c is None for c in self.conv))

    @staticmethod
    def _encode_rows(group: list["EncoderStream"], x: mx.array) -> mx.array:
        """:meth:`_encode` of streams with equal cache shapes, their rows stacked in ``x``."""
        lead = group[0]
        layers = len(lead.encoder.layers)
        if lead._is_steady(x[:1]):
            result = lead._steady(
                x,
                *[mx.concatenate([s.attention[i] for s in group]) for i in range(layers)],
                *[mx.concatenate([s.conv[i] for s in group]) for i in range(layers)],
                *lead._steady_positions(x.dtype),
            )
            x, attention, conv = result[0], result[1 : 1 + layers], result[1 + layers :]
        else:
            attention, conv = [], []
            for index in range(layers):
                cached = None if lead.attention[index] is None else \
                    mx.concatenate([s.attention[index] for s in group])
                previous = None if lead.conv[index] is None else \
                    mx.concatenate([s.conv[index] for s in group])
                length = x.shape[1] + (0 if cached is None else cached.shape[1])
                x, a, c = lead._block(index, x, cached, previous,
                                      lead._pos(index, length, x.dtype), compiled=True)
                attention.append(a)
                conv.append(c)
        for j, stream in enumerate(group):
            stream.attention = [a[j : j + 1] for a in attention]
            stream.conv = [c[j : j + 1] for c in conv]
        return x

    def _encode(self, x: mx.array) -> mx.array:
        """The conformer blocks on new encoder-rate frames ``x``, from the caches."""
        if x.shape[1] == 0:
            return x
        layers = len(self.encoder.layers)
        if self._is_steady(x):
            out = self._steady(x, *self.attention, *self.conv, *self._steady_positions(x.dtype))
            self.attention = list(out[1 : 1 + layers])
            self.conv = list(out[1 + layers :])
            return out[0]
        for index in range(layers):
            cached = self.attention[index]
            length = x.shape[1] + (0 if cached is None else cached.shape[1])
            x, self.attention[index], self.conv[index] = self._block(
                index, x, cached, self.conv[index], self._pos(index, length, x.dtype),
                compiled=True,
            )
        return x
