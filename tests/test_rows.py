"""Row views remember their array: re-stacking a batch's rows in order is free and exact.

A pool steps the same sessions frame after frame; each stage stacks their
state rows and hands each row back. Stacking every row view of one array, in
order, returns that array (no concatenation kernel, the same values); any
other set of rows is concatenated as before.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_voicechat_plugin.models.rows import stack_rows, take_row, take_rows
from mlx_voicechat_plugin.instruments.kernels import graph_primitives


def test_all_rows_in_order_stack_as_their_array():
    batch = mx.arange(12).reshape(3, 4) * 2
    rows = [take_row(batch, b) for b in range(3)]
    assert stack_rows(rows) is batch
    assert "Concatenate" not in graph_primitives(stack_rows(rows))


def test_other_sets_of_rows_are_concatenated_with_the_same_values():
    batch = mx.arange(12).reshape(3, 4)
    rows = [take_row(batch, b) for b in range(3)]
    for parts in ([rows[1], rows[0], rows[2]], rows[:2], [rows[0], rows[1], rows[1]],
                  [rows[0], rows[1], take_row(mx.array(batch), 2)]):
        stacked = stack_rows(parts)
        assert stacked is not batch
        assert mx.array_equal(stacked, mx.concatenate(parts))
    assert take_rows(batch, [0, 1, 2]) is batch
    assert mx.array_equal(take_rows(batch, [0, 2]), batch[mx.array([0, 2])])


def test_one_row_and_one_part_move_nothing():
    one = mx.ones((1, 3))
    assert take_row(one, 0) is one and stack_rows([one]) is one


def test_a_row_views_entry_leaves_with_the_view():
    """The registry behind :func:`stack_rows`' shortcut holds no row longer than the row
    lives, so it does not grow with a conversation's length."""
    from mlx_voicechat_plugin.models import rows

    before = len(rows._VIEWS)
    array = mx.arange(12).reshape(4, 3)
    views = [take_row(array, i) for i in range(4)]
    assert len(rows._VIEWS) == before + 4
    assert stack_rows(views) is array
    del views
    assert len(rows._VIEWS) == before
