"""Weight matrices laid out for the CPU backend's small matrix products.

A frame multiplies one or two rows by every weight matrix. ``nn.Linear``
computes ``x @ W.T`` with ``W`` stored ``[out, in]``; on MLX's CPU backend a
float32 product goes to the linked BLAS (bf16 products are computed through
float32 and rounded once), and with that operand layout the reference BLAS of
MLX's Linux wheels runs its dot-product loop (one scalar running sum per
output). With ``W`` stored transposed (``[in, out]`` row-major, shown to the
module as the same ``[out, in]`` array through a transposed view, so ``W.T``
is contiguous) it runs its ``axpy`` loop, vectorised over the outputs: about
twice as fast for one or two rows. Both loops add each output's products in
input order, starting from zero, so the results are the same bit for bit. The
same holds for the layers that are matrix products in disguise: a kernel-1
``Conv1d`` and a ``ConvTranspose1d`` whose stride equals its kernel (each
output frame is one product of the input frame with the kernel; the codec's
upsampling layers, which MLX otherwise runs as a convolution over a
zero-dilated input).

Where this does NOT hold: a float32 ``mx.addmm(b, x, W.T)`` adds the bias after
the sum in the dot-product loop but before it in the ``axpy`` loop, so biased
float32 layers become :class:`RowMajorLinear` / :class:`RowMajorLSTM`, which
add the bias after the product, as the dot-product loop does; biased bf16
layers (one rounding in ``addmm``, two in product-then-add) and bf16 LSTMs
keep their layout. The equality relies on the BLAS's order of operations, not
on algebra: :func:`layouts_agree` checks it per dtype on the running device
before :func:`relayout` touches anything, and other backends (or another
BLAS) keep the stored layout and MLX's own layers.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

logger = logging.getLogger(__name__)


def channels_last(key: str, value: mx.array, expected: Sequence[int],
                  transposed: bool = False) -> mx.array:
    """A PyTorch conv weight ``[out, in, *k]`` (a transposed conv's ``[in, out, k]``) in
    MLX's layout ``[out, *k, in]``, decided by shape against the module's own parameter
    (``expected``), so an already converted tensor passes through unchanged (a
    checkpoint's ``sanitize`` is idempotent)."""
    if tuple(value.shape) == tuple(expected):
        return value
    moved = value.transpose((1, 2, 0) if transposed else (0, *range(2, value.ndim), 1))
    if tuple(moved.shape) != tuple(expected):
        raise ValueError(f"conv weight {key}: shape {tuple(value.shape)} after layout "
                         f"conversion is {tuple(moved.shape)}, expected {tuple(expected)}")
    return moved


def sanitize_under(prefix: str, weights: dict[str, mx.array],
                   sanitize: Callable[[dict[str, mx.array]], dict[str, mx.array]]
                   ) -> dict[str, mx.array]:
    """``weights`` with the tensors under ``prefix`` mapped by a child module's ``sanitize``
    (which sees keys relative to the child), the others as they are."""
    inner = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    out = {k: v for k, v in weights.items() if not k.startswith(prefix)}
    return out | {prefix + k: v for k, v in sanitize(inner).items()}


def row_major(weight: mx.array) -> mx.array:
    """``weight`` ``[out, in]`` with the same values, stored ``[in, out]`` (``weight.T`` contiguous)."""
    return mx.contiguous(weight.T).T


def held_matrix(module: nn.Module) -> mx.array:
    """The matrix a layer multiplies by (``weight.T``; a pointwise conv's ``weight[:, 0].T``):
    the evaluated view :func:`hold_matrices` made, while the weight is the one it was
    made of, else made here. The view's strides are the ones the expression has in a
    graph, so the product is the same call, bit for bit; held, it is a leaf of every
    graph instead of one to three view nodes per product (each a dispatch on the host)."""
    weight = module["weight"]
    held = module.__dict__.get("_held")
    if held is not None and held[0] is weight:
        return held[1]
    return _matrix(weight)


def _matrix(weight: mx.array) -> mx.array:
    return weight[:, 0, :].T if weight.ndim == 3 else weight.T


class HeldLinear(nn.Linear):
    """``nn.Linear`` (``addmm``, or a product without bias) over its held matrix."""

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, held_matrix(self))
        return x @ held_matrix(self)


class RowMajorLinear(nn.Linear):
    """``nn.Linear`` that adds its bias after the product: ``x @ W.T + b``.

    Bit-identical to ``nn.Linear`` (``addmm``) where :func:`layouts_agree`,
    with ``W`` in either layout.
    """

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ held_matrix(self)
        return y + self["bias"] if "bias" in self else y


class PointwiseConv1d(nn.Conv1d):
    """A kernel-1, stride-1, unpadded ``Conv1d`` as the product ``x @ W[:, 0].T (+ b)``."""

    __call__ = RowMajorLinear.__call__


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


@lru_cache(maxsize=None)
def _probe(device: str, dtype: mx.Dtype) -> bool:
    """Products in ``dtype`` (and, for float32, the bias-after rule) agree across layouts."""
    key = mx.random.key(7)
    checks = []
    for rows, inner, outer in ((1, 257, 96), (2, 64, 33), (5, 31, 128)):
        k1, k2, k3, key = mx.random.split(key, 4)
        x = mx.random.normal((rows, inner), key=k1).astype(dtype)
        w = mx.random.normal((outer, inner), key=k2).astype(dtype)
        b = mx.random.normal((outer,), key=k3).astype(dtype)
        moved = row_major(w)
        checks += [
            (x @ w.T, x @ moved.T),
            (mx.conv1d(x[None], w[:, None, :])[0], x @ moved.T),
        ]
        if dtype == mx.float32:
            checks.append((mx.addmm(b, x, w.T), x @ moved.T + b))
        kernel = 3
        taps = mx.random.normal((outer, kernel, inner), key=k2).astype(dtype)
        up = FrameUpsample(inner, outer, kernel, stride=kernel, bias=False)
        up.weight = mx.contiguous(taps.transpose(2, 1, 0)).transpose(2, 1, 0)
        checks.append((mx.conv_transpose1d(x[None], taps, stride=kernel), up(x[None])))
    return all(mx.array_equal(a.astype(mx.float32), b.astype(mx.float32)).item()
               for a, b in checks)


def layouts_agree(dtype: mx.Dtype = mx.float32) -> bool:
    """Whether this device's products of ``dtype`` weights give the same bits in both
    layouts (probed once per dtype). Other dtypes need float32 to agree as well: a
    product of a ``dtype`` weight with a float32 input runs in float32."""
    device = mx.default_device()
    if device != mx.cpu or dtype not in (mx.float32, mx.bfloat16, mx.float16):
        return False
    return _probe(str(device), mx.float32) and _probe(str(device), dtype)


def _upsamples(module: Any) -> bool:
    return (isinstance(module, nn.ConvTranspose1d) and module.weight.shape[1] == module.stride
            and module.padding == 0 and module.dilation == 1 and module.output_padding == 0)


def _pointwise(module: Any) -> bool:
    return (isinstance(module, nn.Conv1d) and module.weight.shape[1] == 1 and module.stride == 1
            and module.padding == 0 and module.dilation == 1 and module.groups == 1)


def relayout(model: nn.Module, skip: Callable[[str], bool] = lambda name: False) -> int:
    """Store the matrices of ``model``'s linear layers transposed; returns how many.

    Applies to each weight whose dtype :func:`layouts_agree`. Biased ``nn.Linear`` layers become
    :class:`RowMajorLinear`, ``nn.LSTM`` :class:`RowMajorLSTM`, kernel-1 ``Conv1d`` :class:`PointwiseConv1d`,
    frame-rate ``ConvTranspose1d`` :class:`FrameUpsample` (the same module
    objects, so compiled steps built on them stay valid; their parameters keep
    their names, shapes and values). ``skip(name)`` leaves a module alone (one
    whose weight is read other than by its own call). Call it before the first
    compiled step is traced: traces capture the weight arrays they saw.
    """
    moved = []
    for name, module in model.named_modules():
        if skip(name):
            continue
        if type(module) in (nn.LSTM, RowMajorLSTM):
            # Its addmm's bias order depends on the layout; RowMajorLSTM fixes it
            # in float32 only (a bf16 addmm rounds once, a product-then-add twice).
            if module.Wx.dtype == mx.float32 and layouts_agree(mx.float32):
                module.__class__ = RowMajorLSTM
                module.Wx, module.Wh = row_major(module.Wx), row_major(module.Wh)
                moved += [module.Wx, module.Wh]
            continue
        if "weight" not in module or not layouts_agree(module["weight"].dtype):
            continue
        weight = module["weight"]
        if type(module) in (nn.Linear, HeldLinear, RowMajorLinear):
            if "bias" in module:
                if weight.dtype != mx.float32:
                    continue  # as for the LSTM
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
    if not moved:
        logger.info("weight layout kept as stored: this device's products depend on it")
    mx.eval(moved)
    return len(moved)


def hold_matrices(model: nn.Module, layers: Sequence[nn.Module] = ()) -> int:
    """Hold each linear layer's matrix (:func:`held_matrix`) as an evaluated view: the
    layers of ``model`` (a plain ``nn.Linear`` becomes :class:`HeldLinear`, the same
    arithmetic) and ``layers`` outside its tree (fused stacks). A layer whose weight is
    replaced later makes its matrix in the graph again. Returns how many are held."""
    held = []
    for module in [m for _, m in model.named_modules()] + list(layers):
        if type(module) is nn.Linear:
            module.__class__ = HeldLinear
        if type(module) not in (HeldLinear, RowMajorLinear, PointwiseConv1d):
            continue
        weight = module["weight"]
        object.__setattr__(module, "_held", (weight, _matrix(weight)))
        held.append(module.__dict__["_held"][1])
    mx.eval(held)
    return len(held)
