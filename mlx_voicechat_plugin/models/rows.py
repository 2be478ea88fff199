"""Rows of batched state: stacking streams' arrays into ``[B, ...]`` and taking one back out.

A stage's state object (mlx-lm's cache convention: ``merge`` then ``extract``)
stacks its streams' arrays on the first axis and hands each row back. One
stream is the ``B = 1`` case of the same code, where both move no data: a
single part is used as it is and a one-row array is its own row.

A pool's batch holds its members' states stacked between frames (the
timeline's language rows, the codec's ``CodecRows``, the listening half's
``PerceptionRows`` and ``RNNTCarry``), so a steady frame stacks and slices
nothing; these helpers run when the batch forms or changes. A frame's code
rows travel from one stage to the next as :class:`Rows`, which remember the
batch array they came from, so the next stage's batch of the same rows, in
order, is that array again.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx


def stack_rows(parts: Sequence[mx.array]) -> mx.array:
    """``parts`` (each ``[b_i, ...]``) as one ``[sum b_i, ...]`` array; one part as it is."""
    if len(parts) == 1:
        return parts[0]
    return mx.concatenate(list(parts))


def take_row(array: mx.array, index: int) -> mx.array:
    """Row ``index`` of ``[B, ...]`` ``array`` as ``[1, ...]``; a one-row array as it is."""
    if array.shape[0] == 1:
        return array
    return array[index : index + 1]


def take_rows(array: mx.array, indices: Sequence[int]) -> mx.array:
    """Rows ``indices`` (ascending) of ``[B, ...]`` ``array``; all of them as it is."""
    if len(indices) == array.shape[0]:
        return array
    return stack_rows([take_row(array, i) for i in indices])


class Rows(list):
    """A frame's row views handed from one stage to the next (a list of ``[1, ...]``
    arrays), each remembering which batch array and row it is, so the next stage's
    batch of the same rows, in order, is that array (:meth:`stack`)."""

    def __init__(self, rows: Sequence[mx.array] = (),
                 sources: Sequence[tuple[mx.array, int] | None] | None = None):
        super().__init__(rows)
        self.sources = list(sources) if sources is not None else [None] * len(self)

    @classmethod
    def of(cls, array: mx.array) -> "Rows":
        """Every row of ``array``."""
        count = array.shape[0]
        return cls([take_row(array, i) for i in range(count)], [(array, i) for i in range(count)])

    def put(self, index: int, array: mx.array, row: int) -> None:
        """Item ``index`` is row ``row`` of ``array``."""
        self[index] = take_row(array, row)
        self.sources[index] = (array, row)

    def stack(self, members: Sequence[int]) -> mx.array:
        """Items ``members`` stacked: every row of one array, in order, is that array."""
        first = self.sources[members[0]]
        if first is not None and first[0].shape[0] == len(members) and all(
                (source := self.sources[b]) is not None and source[0] is first[0]
                and source[1] == j for j, b in enumerate(members)):
            return first[0]
        return stack_rows([self[b] for b in members])
