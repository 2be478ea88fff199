"""Cache-aware FastConformer streaming, one chunk of mel frames at a time.

:class:`SubsamplingStream` is the causal 8x depthwise-striding subsampling as a
drop-in streaming module: it keeps the last 16 mel frames (the stack's causal
receptive field, kept aligned to the 8-frame grid), reruns the stack over
``cache + new`` only, and returns the encoder frames it has not returned yet,
up to the input's right edge. :class:`EncoderStream` runs the conformer blocks
on those frames with, per layer, the last ``left_context`` (70) attention
inputs and the last ``kernel - 1`` (8) depthwise-conv inputs. Work and memory
per chunk are bounded by these windows.
"""

from __future__ import annotations

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

    def push(self, mel: mx.array) -> mx.array:
        """``(1, n, F)`` new mel frames -> ``(1, k, D)`` new encoder-rate frames."""
        cached = 0 if self.cache is None else self.cache.shape[1]
        window = mel if self.cache is None else mx.concatenate([self.cache, mel], axis=1)
        frames = self.pre_encode(window, mx.array([window.shape[1]], dtype=mx.int32))[0]
        # Encoder frame index of the window's first output.
        first = (self.consumed - cached) // self.factor
        self.consumed += mel.shape[1]
        keep = MEL_CONTEXT + (self.consumed - MEL_CONTEXT) % self.factor
        self.cache = window[:, -keep:]
        start = self.emitted - first
        stop = frames.shape[1]
        self.emitted = first + max(start, stop)
        return frames[:, start:stop] if stop > start else frames[:, :0]


class EncoderStream:
    def __init__(self, encoder: Conformer, left_context: int):
        self.encoder = encoder
        self.left_context = left_context
        self.conv_context = encoder.args.conv_kernel_size - 1
        self.subsampling = SubsamplingStream(encoder.pre_encode, encoder.args.subsampling_factor)
        layers = len(encoder.layers)
        self.attention: list[mx.array | None] = [None] * layers
        self.conv: list[mx.array | None] = [None] * layers

    def state(self) -> list[mx.array]:
        arrays = [a for a in (*self.attention, *self.conv) if a is not None]
        if self.subsampling.cache is not None:
            arrays.append(self.subsampling.cache)
        return arrays

    def _block(self, index: int, x: mx.array) -> mx.array:
        block = self.encoder.layers[index]
        x = x + 0.5 * block.feed_forward1(block.norm_feed_forward1(x))
        # Queries are the new frames; keys/values the cached window plus them.
        q = block.norm_self_att(x)
        cached = self.attention[index]
        kv = q if cached is None else mx.concatenate([cached, q], axis=1)
        pos = self.encoder.pos_enc.pos_emb_for(kv.shape[1], x.dtype)
        x = x + block.self_attn.stream(q, kv, pos)
        self.attention[index] = kv[:, -self.left_context :] if self.left_context else kv[:, :0]
        # Causal depthwise conv over the cached GLU outputs plus the new ones.
        conv = block.conv
        g = nn.glu(conv.pointwise_conv1(block.norm_conv(x)), axis=-1)
        previous = self.conv[index]
        if previous is None:
            previous = mx.zeros((g.shape[0], self.conv_context, g.shape[2]), dtype=g.dtype)
        window = mx.concatenate([previous, g], axis=1)
        self.conv[index] = window[:, -self.conv_context :]
        y = conv.pointwise_conv2(conv.activation(conv.batch_norm(conv.depthwise_conv(window))))
        x = x + y
        x = x + 0.5 * block.feed_forward2(block.norm_feed_forward2(x))
        return block.norm_out(x)

    def push(self, mel: mx.array) -> mx.array:
        """``(1, n, F)`` mel -> ``(1, k, d_model)`` newly encoded frames."""
        x = self.subsampling.push(mel)
        if x.shape[1] == 0:
            return x
        for index in range(len(self.encoder.layers)):
            x = self._block(index, x)
        return x
