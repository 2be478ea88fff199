"""Held matrices (``weight_layout.hold_matrices``): the same product, one view node fewer.

A linear layer multiplies by ``weight.T`` (a pointwise convolution by
``weight[:, 0].T``): a view made in every graph, a node the host dispatches
each time. Held as an evaluated view of the same buffer, with the same
strides, the product is the same call, so the same bits; a weight replaced
later is read again.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_voicechat_plugin.models.weight_layout import (
    HeldLinear, PointwiseConv1d, RowMajorLinear, hold_matrices, row_major,
)
from mlx_voicechat_plugin.instruments.kernels import graph_primitives


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(
        np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))))


def _layers(dtype: mx.Dtype) -> list[tuple[nn.Module, object]]:
    """Layers of each kind that holds a matrix, with the stock call each stands for."""
    mx.random.seed(3)
    plain, biased = nn.Linear(24, 10, bias=False), nn.Linear(24, 10)
    moved = nn.Linear(24, 10)
    moved.__class__ = RowMajorLinear
    moved.weight = row_major(moved.weight)
    conv = nn.Conv1d(24, 10, 1)
    conv.__class__ = PointwiseConv1d
    layers = [(plain, nn.Linear.__call__), (biased, nn.Linear.__call__),
              (moved, RowMajorLinear.__call__), (conv, nn.Conv1d.__call__)]
    for layer, _ in layers:
        layer.set_dtype(dtype)
    return layers


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_a_held_matrix_gives_the_same_bits_without_a_view_node(dtype, rows):
    x = mx.random.normal((rows, 1, 24), key=mx.random.key(rows)).astype(dtype)
    for layer, stock in _layers(dtype):
        before = stock(layer, x)
        assert hold_matrices(layer) == 1
        after = layer(x)
        assert _same(before, after), type(layer).__name__
        views = {"Transpose", "Slice", "Squeeze"}  # the views that made the matrix
        assert not views & set(graph_primitives(layer(x)) - graph_primitives(x)), \
            (type(layer).__name__, graph_primitives(layer(x)))


def test_a_plain_linear_layer_becomes_held_and_a_replaced_weight_is_read_again():
    layer = nn.Linear(8, 4)
    hold_matrices(layer)
    assert type(layer) is HeldLinear
    x = mx.ones((2, 8))
    layer.weight = layer.weight * 2  # replaced after holding: the new one is multiplied
    assert _same(layer(x), mx.addmm(layer.bias, x, layer.weight.T))


def test_a_loaded_model_holds_every_linear_layer(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, _ = load(tiny_ckpt)
    kinds = (HeldLinear, RowMajorLinear, PointwiseConv1d)
    layers = [m for _, m in model.named_modules() if type(m) in kinds]
    assert layers and all(m.__dict__["_held"][0] is m["weight"] for m in layers)
    assert not any(type(m) is nn.Linear for _, m in model.named_modules())
