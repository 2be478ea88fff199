"""Weight matrices laid out for the CPU backend's small matrix products.

A frame multiplies one or two rows by every weight matrix. ``nn.Linear``
computes ``x @ W.T`` with ``W`` stored ``[out, in]``; on MLX's CPU backend a
float32 product goes to the linked BLAS, and with that operand layout the
reference BLAS of MLX's Linux wheels runs its dot-product loop (one scalar
running sum per output). With ``W`` stored transposed (``[in, out]`` row-major,
shown to the module as the same ``[out, in]`` array through a transposed view,
so ``W.T`` is contiguous) it runs its ``axpy`` loop, vectorised over the
outputs: about twice as fast for one or two rows. Both loops add each output's
products in input order, starting from zero, so the results are the same bit
for bit. The same holds for the layers that are matrix products in disguise:
a kernel-1 ``Conv1d`` and a ``ConvTranspose1d`` whose stride equals its kernel
(each output frame is one product of the input frame with the kernel).

Where this does NOT hold: ``mx.addmm(b, x, W.T)`` adds the bias after the sum
in the dot-product loop but before it in the ``axpy`` loop, so biased layers
become :class:`RowMajorLinear`, which adds the bias after the product, as the
dot-product loop does. The equality relies on the BLAS's order of operations,
not on algebra: :func:`layouts_agree` checks it on the running device before
:func:`relayout` touches anything, and other backends (or another BLAS) keep
the stored layout and MLX's own layers.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

logger = logging.getLogger(__name__)


def row_major(weight: mx.array) -> mx.array:
    """``weight`` ``[out, in]`` with the same values, stored ``[in, out]`` (``weight.T`` contiguous)."""
    return mx.contiguous(weight.T).T


class RowMajorLinear(nn.Linear):
    """``nn.Linear`` that adds its bias after the product: ``x @ W.T + b``.

    Bit-identical to ``nn.Linear`` (``addmm``) where :func:`layouts_agree`,
    with ``W`` in either layout.
    """

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self["weight"].T
        return y + self["bias"] if "bias" in self else y


class PointwiseConv1d(nn.Conv1d):
    """A kernel-1, stride-1, unpadded ``Conv1d`` as the product ``x @ W[:, 0].T (+ b)``."""

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self["weight"][:, 0, :].T
        return y + self["bias"] if "bias" in self else y


class FrameUpsample(nn.ConvTranspose1d):
    """A ``ConvTranspose1d`` with ``stride == kernel`` and no padding as one product.

    Output frame ``t * k + j`` is input frame ``t`` times kernel tap ``j``:
    ``[B, T, C] @ [C, k * O]`` reshaped to ``[B, T * k, O]``. The weight is kept
    as a ``[O, k, C]`` view of a ``[C, k, O]`` buffer (:func:`relayout`), so
    the matrix is that buffer, unmoved.
    """

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        out, kernel, channels = weight.shape
        batch, frames, _ = x.shape
        matrix = weight.transpose(2, 1, 0).reshape(channels, kernel * out)
        y = (x.reshape(batch * frames, channels) @ matrix).reshape(batch, frames * kernel, out)
        return y + self["bias"] if "bias" in self else y


class RowMajorLSTM(nn.LSTM):
    """``nn.LSTM`` that adds the bias and the input term after each product, as the
    dot-product loop's ``addmm`` does; bit-identical where :func:`layouts_agree`."""

    def __call__(self, x, hidden=None, cell=None):
        x = x @ self.Wx.T
        if self.bias is not None:
            x = x + self.bias
        all_hidden, all_cell = [], []
        for idx in range(x.shape[-2]):
            ifgo = x[..., idx, :]
            if hidden is not None:
                ifgo = hidden @ self.Wh.T + ifgo
            i, f, g, o = mx.split(ifgo, 4, axis=-1)
            i, f, g, o = mx.sigmoid(i), mx.sigmoid(f), mx.tanh(g), mx.sigmoid(o)
            cell = i * g if cell is None else f * cell + i * g
            hidden = o * mx.tanh(cell)
            all_cell.append(cell)
            all_hidden.append(hidden)
        return mx.stack(all_hidden, axis=-2), mx.stack(all_cell, axis=-2)


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(np.array_equal(np.array(a), np.array(b)))


@lru_cache(maxsize=None)
def _probe(device: str) -> bool:
    key = mx.random.key(7)
    checks = []
    for rows, inner, outer in ((1, 257, 96), (2, 64, 33), (5, 31, 128)):
        k1, k2, k3, key = mx.random.split(key, 4)
        x = mx.random.normal((rows, inner), key=k1)
        w = mx.random.normal((outer, inner), key=k2)
        b = mx.random.normal((outer,), key=k3)
        moved = row_major(w)
        checks += [
            (x @ w.T, x @ moved.T),
            (mx.addmm(b, x, w.T), x @ moved.T + b),
            (mx.conv1d(x[None], w[:, None, :])[0], x @ moved.T),
        ]
        kernel = 3
        taps = mx.random.normal((outer, kernel, inner), key=k2)
        up = FrameUpsample(inner, outer, kernel, stride=kernel, bias=False)
        up.weight = mx.contiguous(taps.transpose(2, 1, 0)).transpose(2, 1, 0)
        checks.append((mx.conv_transpose1d(x[None], taps, stride=kernel), up(x[None])))
    return all(_same(a, b) for a, b in checks)


def layouts_agree() -> bool:
    """Whether this device's products give the same bits in both layouts (probed once)."""
    device = mx.default_device()
    return device == mx.cpu and _probe(str(device))


def _upsamples(module: Any) -> bool:
    return (isinstance(module, nn.ConvTranspose1d) and module.weight.shape[1] == module.stride
            and module.padding == 0 and module.dilation == 1 and module.output_padding == 0)


def _pointwise(module: Any) -> bool:
    return (isinstance(module, nn.Conv1d) and module.weight.shape[1] == 1 and module.stride == 1
            and module.padding == 0 and module.dilation == 1 and module.groups == 1)


def relayout(model: nn.Module, skip: Callable[[str], bool] = lambda name: False) -> int:
    """Store the float32 matrices of ``model``'s linear layers transposed; returns how many.

    Applies only where :func:`layouts_agree`. Biased ``nn.Linear`` layers become
    :class:`RowMajorLinear`, ``nn.LSTM`` :class:`RowMajorLSTM`, kernel-1 ``Conv1d`` :class:`PointwiseConv1d`,
    frame-rate ``ConvTranspose1d`` :class:`FrameUpsample` (the same module
    objects, so compiled steps built on them stay valid; their parameters keep
    their names, shapes and values). ``skip(name)`` leaves a module alone (one
    whose weight is read other than by its own call). Call it before the first
    compiled step is traced: traces capture the weight arrays they saw.
    """
    if not layouts_agree():
        logger.info("weight layout kept as stored: this device's products depend on it")
        return 0
    moved = []
    for name, module in model.named_modules():
        if skip(name):
            continue
        if type(module) in (nn.LSTM, RowMajorLSTM) and module.Wx.dtype == mx.float32:
            module.__class__ = RowMajorLSTM
            module.Wx, module.Wh = row_major(module.Wx), row_major(module.Wh)
            moved += [module.Wx, module.Wh]
            continue
        if "weight" not in module or module["weight"].dtype != mx.float32:
            continue
        weight = module["weight"]
        if type(module) in (nn.Linear, RowMajorLinear):
            if "bias" in module:
                module.__class__ = RowMajorLinear
            module.weight = row_major(weight)
        elif type(module) in (nn.Conv1d, PointwiseConv1d) and _pointwise(module):
            module.__class__ = PointwiseConv1d
            module.weight = row_major(weight[:, 0, :])[:, None, :]
        elif type(module) in (nn.ConvTranspose1d, FrameUpsample) and _upsamples(module):
            module.__class__ = FrameUpsample
            module.weight = mx.contiguous(weight.transpose(2, 1, 0)).transpose(2, 1, 0)
        else:
            continue
        moved.append(module.weight)
    mx.eval(moved)
    return len(moved)
