"""Rows of batched state: stacking streams' arrays into ``[B, ...]`` and taking one back out.

A stage's state object (mlx-lm's cache convention: ``merge`` then ``extract``)
stacks its streams' arrays on the first axis and hands each row back. One
stream is the ``B = 1`` case of the same code, where both move no data: a
single part is used as it is and a one-row array is its own row.

A pool's batch holds its members' states stacked between frames (the
timeline's language rows, the codec's ``CodecRows``, the hearing half's
``PerceptionRows`` and ``RNNTCarry``), so a steady frame stacks and slices
nothing; these helpers run when the batch forms or changes. A frame's
outputs go from one stage to the next as whole ``[B, ...]`` arrays, each
stage taking the rows it runs (:func:`take_rows`: all of them, the array as
it is).
"""

from __future__ import annotations

from typing import Any, Sequence

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


def own_row(array: mx.array, index: int, copy: bool = True) -> mx.array:
    """Row ``index`` of ``[B, ...]`` ``array`` as ``[1, ...]`` in a buffer of its own (a
    copy, made when evaluated), for a row a batch gives back: a slice would keep the
    batch's whole buffer alive for as long as the row is kept; a one-row array as it is.
    ``copy=False``: the slice, for a row stacked again at once."""
    row = take_row(array, index)
    return row if row is array or not copy else mx.contiguous(row)


def keep_rows(array: mx.array, keep: Sequence[int]) -> mx.array:
    """Rows ``keep`` (ascending) of ``[B, ...]`` ``array`` in a buffer of their own (one
    gather)."""
    return mx.take(array, mx.array(list(keep)), axis=0)


def drop_row(array: mx.array, index: int) -> mx.array:
    """``[B, ...]`` ``array`` without row ``index``, in a buffer of its own (a copy)."""
    return keep_rows(array, [b for b in range(array.shape[0]) if b != index])


def take_rows(array: mx.array, indices: Sequence[int]) -> mx.array:
    """Rows ``indices`` (ascending) of ``[B, ...]`` ``array``; all of them as it is."""
    if len(indices) == array.shape[0]:
        return array
    return stack_rows([take_row(array, i) for i in indices])


class RowGroups:
    """``B`` rows of one stage's state held stacked between frames, one group per key.

    Rows whose states have the same ``key()`` (the shapes or the phase that
    must be equal to stack: an encoder window's length, a codec stream's
    phase) are one state of the stage's ``kind``, stacked by ``kind.merge``;
    a row that started later is a group of its own until its key meets the
    others', when :meth:`regroup` stacks them once (a group whose rows do not
    change stays as it is). ``groups`` is ``(rows, ascending; their state)``.
    A state gives ``extract(index, copy)`` (``copy=False``: slices, for a row
    stacked again at once), ``filter(keep)`` (the rows ``keep`` as one state, one
    gather per array), ``key()``, ``state`` and ``row_nbytes``.
    """

    kind: Any = None

    def __init__(self, groups: list[tuple[list[int], Any]], kind: Any = None):
        self.groups = groups
        self.kind = kind or self.kind

    @classmethod
    def merge(cls, rows: Sequence[Any], kind: Any = None) -> "RowGroups":
        """``rows`` (one-row states) as rows ``0..B-1``, stacked by key."""
        groups = cls([], kind)
        groups.extend(rows)
        return groups

    @property
    def size(self) -> int:
        return sum(len(members) for members, _ in self.groups)

    def where(self, index: int) -> tuple[int, Any]:
        """Row ``index``'s ``(row in its group, the group's state)``."""
        for members, state in self.groups:
            if index in members:
                return members.index(index), state
        raise IndexError(f"row {index} out of range ({self.size} rows)")

    def extract(self, index: int, copy: bool = True) -> Any:
        """Row ``index``'s own one-row state (a group of one: its state itself)."""
        row, state = self.where(index)
        return state.extract(row, copy)

    def extend(self, rows: Sequence[Any]) -> None:
        """``rows`` (one-row states) appended after the others, grouped by key: a row whose
        key is a group's joins it now (:meth:`regroup`), so the next frame runs it there."""
        self.groups += [([b], self.kind.merge([row])) for b, row in enumerate(rows, self.size)]
        self.regroup()

    def remove(self, index: int) -> Any:
        """Row ``index``'s own state (a copy); the others stay stacked, renumbered."""
        own = self.extract(index)
        groups = []
        for members, group in self.groups:
            rest = [b for b in members if b != index]
            if len(rest) < len(members) and rest:
                group = group.filter([members.index(b) for b in rest])
            if rest:
                groups.append(([b - (b > index) for b in rest], group))
        self.groups = groups
        return own

    def split(self) -> list[Any]:
        """Every row's own state, in order (copies); the groups are given up."""
        rows = [self.extract(b) for b in range(self.size)]
        self.groups = []
        return rows

    def regroup(self) -> None:
        """Stack the groups whose keys have met (rows that started later caught up)."""
        keys = [state.key() for _, state in self.groups]
        if len(set(keys)) == len(keys):
            return
        keyed: dict = {}
        for (members, _), key in zip(self.groups, keys):
            keyed.setdefault(key, []).extend(members)
        kept = {tuple(members): state for members, state in self.groups}
        self.groups = [(rows, kept[tuple(rows)] if tuple(rows) in kept else
                        self.kind.merge([self.extract(b, copy=False) for b in rows]))
                       for rows in map(sorted, keyed.values())]

    def row_nbytes(self, index: int) -> int:
        """The bytes of row ``index``'s own state, without taking it out."""
        return self.where(index)[1].row_nbytes

    @property
    def state(self) -> list[mx.array]:
        """Every group's arrays (evaluating them evaluates every row's state)."""
        return [a for _, state in self.groups for a in state.state]
