"""Rows remember their batch: re-stacking a batch's rows in order is free and exact.

A pool steps the same sessions frame after frame; each stage stacks their
state rows and hands each row back. The rows themselves name their batch
(nothing is kept elsewhere): stacking every row of one batch, in order,
returns its array (no concatenation kernel, the same values); any other set
of rows is concatenated, with the same values.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_voicechat_plugin.models.rows import (
    Rows,
    stack_rows,
    take_row,
    take_rows,
)
from mlx_voicechat_plugin.instruments.kernels import graph_primitives


def test_all_rows_in_order_stack_as_their_array():
    batch = mx.arange(12).reshape(3, 4) * 2
    rows = Rows.of(batch)
    assert rows.stack([0, 1, 2]) is batch
    assert "Concatenate" not in graph_primitives(rows.stack([0, 1, 2]))


def test_other_sets_of_rows_are_concatenated_with_the_same_values():
    batch = mx.arange(12).reshape(3, 4)
    rows = Rows.of(batch)
    for members in ([1, 0, 2], [0, 1], [0, 1, 1]):
        stacked = rows.stack(members)
        assert stacked is not batch
        assert mx.array_equal(stacked, mx.concatenate([rows[b] for b in members]))
    rows.put(2, mx.array(batch), 2)  # another array's row
    assert rows.stack([0, 1, 2]) is not batch
    assert mx.array_equal(rows.stack([0, 1, 2]), batch)
    assert take_rows(batch, [0, 1, 2]) is batch
    assert mx.array_equal(take_rows(batch, [0, 2]), batch[mx.array([0, 2])])


def test_one_row_and_one_part_move_nothing():
    one = mx.ones((1, 3))
    assert take_row(one, 0) is one and stack_rows([one]) is one
