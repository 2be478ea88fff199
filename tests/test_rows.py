"""Rows of a batch: taking every row in order is the array itself, free and exact.

A pool's batches hold their rows stacked and hand a stage whole arrays; a
stage that runs some of the rows takes them (any set is concatenated, with
the same values), and one that runs all of them takes the array as it is
(no concatenation kernel). Rows that stack only with rows of the same key (a
window's length, a codec's phase) are held as :class:`RowGroups`.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_voicechat_plugin.models.rows import (
    RowGroups,
    keep_rows,
    own_row,
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


class Phased:
    """A toy stage state: ``[B, 1]`` rows and a key (its phase) every row of it shares."""

    merges = 0

    def __init__(self, value: mx.array, phase: int):
        self.value, self.phase = value, phase

    @classmethod
    def merge(cls, rows: list["Phased"]) -> "Phased":
        if len(rows) == 1:
            return rows[0]
        cls.merges += 1
        return cls(stack_rows([r.value for r in rows]), rows[0].phase)

    def extract(self, index: int, copy: bool = True) -> "Phased":
        return self if self.value.shape[0] == 1 else Phased(own_row(self.value, index, copy),
                                                             self.phase)

    def filter(self, keep: list[int]) -> "Phased":
        return Phased(keep_rows(self.value, keep), self.phase)

    def key(self) -> int:
        return self.phase

    @property
    def state(self) -> list[mx.array]:
        return [self.value]

    @property
    def row_nbytes(self) -> int:
        return self.value.nbytes // self.value.shape[0]


def test_rows_stack_by_key_and_a_late_row_joins_its_group_once_their_keys_meet():
    rows = [Phased(mx.array([[b]]), phase) for b, phase in enumerate((1, 0, 1, 0))]
    held = RowGroups.merge(rows, Phased)
    assert [members for members, _ in held.groups] == [[0, 2], [1, 3]]
    assert [held.extract(b).value.item() for b in range(4)] == [0, 1, 2, 3]
    assert held.row_nbytes(3) == rows[3].value.nbytes and len(held.state) == 2
    late = held.groups[1][1]
    stayed = held.groups[0][1]
    held.regroup()  # keys differ: nothing moves
    assert held.groups[1][1] is late
    late.phase = 1  # the late rows caught up: one stack, in row order
    merges = Phased.merges
    held.regroup()
    ((members, state),) = held.groups
    assert members == [0, 1, 2, 3] and Phased.merges == merges + 1
    assert state.value.flatten().tolist() == [0, 1, 2, 3] and state is not stayed


def test_a_group_whose_rows_do_not_change_stays_when_others_join():
    rows = [Phased(mx.array([[b]]), phase) for b, phase in enumerate((0, 1, 2))]
    held = RowGroups.merge(rows, Phased)
    first = held.groups[0][1]
    held.groups[2][1].phase = 1  # row 2 meets row 1; row 0 is left as it is
    held.regroup()
    assert [members for members, _ in held.groups] == [[0], [1, 2]]
    assert held.groups[0][1] is first


def test_split_gives_every_row_its_own_state():
    values = mx.concatenate([mx.array([[b]]) for b in range(3)])
    mx.eval(values)  # one stack, as a batch holds it
    held = RowGroups([([0, 1, 2], Phased(values, 0))], Phased)
    own = held.split()
    assert held.groups == []
    assert [sorted(graph_primitives(r.value)) for r in own] == [
        ["Contiguous", "Slice"]] * 3  # copies: no row keeps the stack alive
    assert [r.value.item() for r in own] == [0, 1, 2]


def test_a_leaving_row_is_a_copy_and_the_rows_that_stay_one_gather_in_order():
    values = mx.arange(4).reshape(4, 1)
    mx.eval(values)  # one stack, as a batch holds it
    held = RowGroups([([0, 1, 2, 3], Phased(values, 0))], Phased)
    own = held.remove(1)
    ((members, state),) = held.groups
    assert "Contiguous" in graph_primitives(own.value)  # its own buffer
    assert "Concatenate" not in graph_primitives(state.value)  # not the rows stacked again
    assert own.value.item() == 1
    assert members == [0, 1, 2] and state.value.flatten().tolist() == [0, 2, 3]
