"""Rows of batched state: stacking streams' arrays into ``[B, ...]`` and taking one back out.

A stage's state object (mlx-lm's cache convention: ``merge`` then ``extract``)
stacks its streams' arrays on the first axis and hands each row back. One
stream is the ``B = 1`` case of the same code, where both move no data: a
single part is used as it is and a one-row array is its own row.

A batch that steps again with the same rows in the same order stacks nothing:
a state object hands its rows back unsliced (:class:`SharedRows`: each row
names its batch and its index, and slices only when read on its own), and a
merge of every row of one batch, in order, is that batch's arrays again
(:func:`shared_arrays`: the codec state; the listening half's states are
held stacked by their batch instead). The rows know their batch; nothing is
kept anywhere else.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

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


class SharedRows:
    """The ``[B, ...]`` arrays of one batched step, shared by its ``B`` rows until one is
    read on its own (no slice per row and array in the steady case)."""

    __slots__ = ("arrays", "rows", "row_nbytes")

    def __init__(self, arrays: Sequence[mx.array | None], rows: int):
        self.arrays, self.rows = tuple(arrays), rows
        # One row's share of the arrays' bytes, sized once for all of its rows.
        self.row_nbytes = sum(a.nbytes for a in self.arrays if a is not None) // rows

    def row(self, index: int) -> list[mx.array | None]:
        """Row ``index``'s slices of every array."""
        return [None if a is None else take_row(a, index) for a in self.arrays]


def shared_arrays(caches: Sequence[Any], current: Callable[[Any], Any] | None = None
                  ) -> tuple[mx.array | None, ...] | None:
    """The batch arrays when ``caches`` (objects holding row ``_row`` of ``_shared``) are
    every row of one :class:`SharedRows`, in order. ``current``: for objects that keep
    their row's slices too (:func:`link_row`), what they hold now, which must still be
    what they were handed (``_linked``)."""
    first = getattr(caches[0], "_shared", None)
    if first is None or first.rows != len(caches):
        return None
    for row, cache in enumerate(caches):
        if cache._shared is not first or cache._row != row or (
                current is not None and cache._linked is not current(cache)):
            return None
    return first.arrays


class LinkedRow:
    """What an object that keeps its row's slices remembers of the batch they came from
    (:func:`link_row`): the batch, its row, and the slices it was handed."""

    _shared: SharedRows | None = None
    _row = 0
    _linked: Any = None

    def whole(self, current: Any) -> Any:
        """The batch's first array while ``current`` is still the slice it was handed."""
        return current if self._shared is None or self._linked is not current \
            else self._shared.arrays[0]


def link_row(holder: LinkedRow, shared: SharedRows, row: int, current: Any) -> None:
    """``holder`` (which keeps ``current``, its slices of row ``row``) remembers that they
    are row ``row`` of ``shared``, for :func:`shared_arrays` to stack them for free while
    it still holds them."""
    holder._shared, holder._row, holder._linked = shared, row, current


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
