"""Rows of a batch: taking every row in order is the array itself, free and exact.

A pool's batches hold their rows stacked and hand a stage whole arrays; a
stage that runs some of the rows takes them (any set is concatenated, with
the same values), and one that runs all of them takes the array as it is
(no concatenation kernel).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_voicechat_plugin.models.rows import (
    stack_rows,
    take_row,
    take_rows,
)
from mlx_voicechat_plugin.instruments.kernels import graph_primitives


def test_rows_of_a_batch_are_taken_with_their_values():
    batch = mx.arange(12).reshape(3, 4)
    assert take_rows(batch, [0, 1, 2]) is batch  # every row, in order: the array itself
    assert "Concatenate" not in graph_primitives(take_rows(batch, [0, 1, 2]))
    for members in ([0, 2], [1], [0, 1]):
        assert mx.array_equal(take_rows(batch, members), batch[mx.array(members)])
    assert mx.array_equal(stack_rows([batch[1:2], batch[:1]]), batch[mx.array([1, 0])])


def test_one_row_and_one_part_move_nothing():
    one = mx.ones((1, 3))
    assert take_row(one, 0) is one and stack_rows([one]) is one
