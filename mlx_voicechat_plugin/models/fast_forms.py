"""Where ``mx.fast`` ops expand, and the expanded forms that launch fewer kernels there.

On a GPU each ``mx.fast`` op (``rms_norm``, ``layer_norm``, ``rope``,
``scaled_dot_product_attention``) is one kernel. On MLX's CPU backend the same
call builds its *fallback* graph instead (``mlx/fast.cpp``): RMSNorm is a
square, a sum and a fused tail (3 kernels compiled), LayerNorm 5, RoPE about
11 (two ``arange``, ``exp``, ``cos``, ``sin``, casts, the rotation and a
concatenation), recomputed for every call. The forms in this module compute
exactly the fallback's arithmetic, op for op, so their results are the fast
op's bit for bit on the CPU, but share or fuse what the fallback repeats.
They are used only where :func:`fast_ops_expand` holds; a GPU keeps the one
kernel ``mx.fast`` launches.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def fast_ops_expand() -> bool:
    """True where ``mx.fast`` ops run as their fallback graphs (MLX's CPU backend)."""
    return mx.default_device().type == mx.DeviceType.cpu


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, w, eps)`` where ``weight`` may be one ``w`` per row.

    The fallback normalizes in float32, casts to the result type of ``x`` and
    the weight, and multiplies by the weight cast to it. Normalizing without a
    weight and multiplying after is the same arithmetic (``x`` widened to the
    result type first, which is exact), so ``weight`` may broadcast over more
    than the last axis: e.g. one stacked norm over q and k heads, each head
    with its own norm's weight.
    """
    out = mx.result_type(x, weight)
    return mx.fast.rms_norm(x.astype(out), None, eps) * weight.astype(out)


class RopeForm:
    """A plain RoPE (``nn.RoPE``, not traditional) as the fallback's tables and rotation.

    The fallback computes positions, inverse frequencies, angles and their
    cosines and sines for every call; these depend only on the offsets and the
    RoPE's ``(dims, base, scale)``, so :meth:`angles` computes them once for
    every input rotated at those offsets and :meth:`__call__` rotates with
    them. ``angles`` gives float32 tables; the rotation casts them to the
    input's dtype as the fallback does. The inverse frequencies depend on
    nothing per call and are made once.
    """

    # Offsets the rotation is checked at before a form is used: small, around
    # powers of two, and far positions where a one-ulp frequency would show.
    PROBE_OFFSETS = (0, 1, 2, 3, 37, 64, 255, 1023, 4095, 8191, 65535, 131071, 1_000_003)

    def __init__(self, dims: int, base: float, scale: float):
        self.dims, self.base, self.scale = dims, base, scale
        half = dims // 2
        # The fallback's constant: log of the float32 base, in float32, over half.
        log_base = np.float32(math.log(np.float32(base)))
        step = mx.array(np.float32(log_base / np.float32(half)), dtype=mx.float32)
        self.inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * step)
        self._scale = mx.array(scale, dtype=mx.float32)
        mx.eval(self.inv_freqs, self._scale)

    @classmethod
    def of(cls, rope: Any) -> RopeForm | None:
        """The form of ``rope`` where it is one and rotates as ``mx.fast.rope`` does here
        (checked once per ``(dims, base, scale)``); ``None`` otherwise."""
        if type(rope) is not nn.RoPE or rope.traditional or rope.dims % 2:
            return None
        device = str(mx.default_device())
        return _probed(int(rope.dims), float(rope.base), float(rope.scale), device)

    def angles(self, offset: mx.array, length: int = 1) -> tuple[mx.array, mx.array]:
        """Float32 cosines and sines at positions ``offset + arange(length)``, shaped as
        the fallback's: ``[B, 1, length, dims/2]`` for one offset per row ``[B]``,
        ``[length, dims/2]`` for a scalar offset."""
        if offset.ndim == 1:
            offset = offset[:, None, None]
        # arange(1) + offset is the offset in float32 (0 + p is p)
        positions = (offset.astype(mx.float32) if length == 1
                     else mx.arange(length, dtype=mx.float32) + offset)
        theta = (positions * self._scale)[..., None] * self.inv_freqs
        return mx.cos(theta), mx.sin(theta)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """``mx.fast.rope(x, dims, base=base, scale=scale, offset=offset)`` from the
        :meth:`angles` at ``offset`` (``x`` is ``[B, heads, length, head_dim]``)."""
        half = self.dims // 2
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        x1, x2 = x[..., :half], x[..., half : self.dims]
        parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if self.dims < x.shape[-1]:
            parts.append(x[..., self.dims :])
        return mx.concatenate(parts, axis=-1)

    def agrees(self) -> bool:
        """Whether the form rotates exactly as ``mx.fast.rope`` on this device, run as
        it is and compiled (tables and rotation each one compiled function, as in a step)."""
        offset = mx.array(self.PROBE_OFFSETS, dtype=mx.int32)
        x = mx.random.normal((len(self.PROBE_OFFSETS), 2, 1, self.dims), key=mx.random.key(5))
        angles, rotate = mx.compile(self.angles), mx.compile(self.__call__)
        for dtype in (mx.float32, mx.bfloat16):
            xd = x.astype(dtype)
            expected = mx.fast.rope(xd, self.dims, traditional=False, base=self.base,
                                    scale=self.scale, offset=offset)
            for got in (self(xd, *self.angles(offset)), rotate(xd, *angles(offset))):
                if not mx.array_equal(got, expected).item():
                    return False
        return True


@functools.lru_cache(maxsize=None)
def _probed(dims: int, base: float, scale: float, device: str) -> RopeForm | None:
    form = RopeForm(dims, base, scale)
    return form if form.agrees() else None


# -- LayerNorm -------------------------------------------------------------------------


def layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None,
               eps: float) -> mx.array:
    """``mx.fast.layer_norm(x, weight, bias, eps)`` as its CPU fallback computes it,
    in 4 kernels under ``mx.compile`` where the fallback takes 5.

    The fallback (``mlx/fast.cpp``): ``x`` in float32, ``mu = mean(x)`` (a sum
    times the float32 reciprocal of the count, ``mean`` in ``mlx/ops.cpp``),
    ``xc = x - mu``, ``v = mean(square(xc))``, ``xc * rsqrt(v + eps)`` cast to
    the result type, then ``* weight`` and ``+ bias`` each cast to that type.
    Compiled, that is a sum, a kernel writing ``xc`` (read twice), the square,
    the second sum and the tail. Here ``xc`` is never written: the square's
    kernel and the tail each recompute ``x - mu`` from the first sum, the same
    float32 operations on the same values, so the same bits. ``mu`` is spelt
    ``sm * inv`` in one and ``inv * sm`` in the other (equal bits: IEEE
    multiplication commutes) so that compile's common-subexpression pass does
    not merge them back into one array that a kernel would have to write.
    """
    # The fallback's rule: without a weight, the bias does not promote.
    out_type = x.dtype if weight is None else mx.result_type(
        *(a for a in (x, weight, bias) if a is not None))
    y = _centered(x.astype(mx.float32), eps).astype(out_type)
    if weight is not None:
        y = y * weight.astype(out_type)
    if bias is not None:
        y = y + bias.astype(out_type)
    return y


class ExpandedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that runs :func:`layer_norm` where :func:`fast_ops_expand`.

    Same parameters (``weight``, ``bias``), so checkpoint keys, ``update`` and
    quantization see the module they saw. :func:`expand_layer_norms` turns a
    model's ``nn.LayerNorm`` modules into these in place.
    """

    def __call__(self, x: mx.array) -> mx.array:
        if not fast_ops_expand():
            return super().__call__(x)
        return layer_norm(x, self.get("weight"), self.get("bias"), self.eps)


def expand_layer_norms(model: nn.Module) -> int:
    """Make every ``nn.LayerNorm`` in ``model`` an :class:`ExpandedLayerNorm` (the same
    objects, class changed); returns how many. Idempotent."""
    norms = [module for _, module in model.named_modules() if type(module) is nn.LayerNorm]
    for module in norms:
        module.__class__ = ExpandedLayerNorm
    return len(norms)


# -- Attention ---------------------------------------------------------------------------


def attention_prescaled(q_scaled: mx.array, k: mx.array, v: mx.array,
                        mask: mx.array) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask=mask)`` as its CPU
    fallback computes it, given ``q_scaled = mx.array(s, q.dtype) * q``.

    The fallback's first kernel multiplies ``q`` by the scale (in ``q``'s dtype),
    always; a caller whose ``q`` comes out of its own elementwise kernel does that
    multiply there instead. The rest is the fallback's: ``q k^T``, the additive
    mask (cast to the scores' dtype), a precise softmax, the product with ``v``.
    Same heads for ``q``, ``k`` and ``v`` (no grouped-query repeat) and an additive
    mask only: the shapes :func:`encoder_stream._attend_kv` gives it.
    """
    if q_scaled.shape[1] != k.shape[1] or mask.dtype == mx.bool_:
        raise ValueError("attention_prescaled: one key head per query head, additive mask")
    scores = mx.matmul(q_scaled, k.swapaxes(-1, -2))
    scores = scores + mask.astype(scores.dtype)
    return mx.matmul(mx.softmax(scores, axis=-1, precise=True), v)


# -- mean / var normalization -----------------------------------------------------------


def mean_var_norm(x: mx.array, weight: mx.array, bias: mx.array, eps: float) -> mx.array:
    """``(x - mx.mean(x, -1)) * mx.rsqrt(mx.var(x, -1) + eps) * weight + bias`` (means
    kept) for floating ``x``, in 4 kernels under ``mx.compile`` where that takes 5.

    Written out, ``mean`` and ``var``'s own mean are one sum times the count's
    reciprocal in ``x``'s dtype (``mean``/``var`` in ``mlx/ops.cpp``); ``var``
    squares ``x - mean``, which compile shares with the tail and so writes once. As
    in :func:`layer_norm`, both kernels recompute it instead, from the sum, in the
    same operations of the same dtype.
    """
    if not mx.issubdtype(x.dtype, mx.floating):
        raise ValueError(f"mean_var_norm: floating input, got {x.dtype}")
    return _centered(x, eps) * weight + bias


def _centered(x: mx.array, eps: float) -> mx.array:
    """``(x - mean) * rsqrt(mean(square(x - mean)) + eps)`` over the last axis, in ``x``'s
    dtype, with ``x - mean`` computed twice (never written; see :func:`layer_norm`).

    ``mean`` is one sum times the count's reciprocal rounded to ``x``'s dtype, as
    ``mean`` in ``mlx/ops.cpp`` computes it; ``eps`` is added in that dtype.
    """
    inv = mx.array(1.0 / x.shape[-1], x.dtype)
    sm = mx.sum(x, axis=-1, keepdims=True)
    var = mx.sum(mx.square(x - inv * sm), axis=-1, keepdims=True) * inv
    return (x - sm * inv) * mx.rsqrt(var + eps)
