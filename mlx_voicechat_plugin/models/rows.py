"""Rows of batched state: stacking streams' arrays into ``[B, ...]`` and taking one back out.

A stage's state object (mlx-lm's cache convention: ``merge`` then ``extract``)
stacks its streams' arrays on the first axis and hands each row back. One
stream is the ``B = 1`` case of the same code, where both move no data: a
single part is used as it is and a one-row array is its own row.

A batch that steps again with the same rows in the same order stacks nothing.
A state object whose rows are read only by the next step hands them back
unsliced (:class:`SharedRows`, as :class:`RowArraysCache` does for Mamba2
states): each row names its batch and its index, and slices only when read on
its own. Elsewhere
:func:`take_row` remembers which array and row each row view came from, and
:func:`stack_rows` of every row view of one array, in order, is that array
(the same values, so the same bits; no concatenation kernel). A pool that
steps the same sessions frame after frame then re-stacks none of their state.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import mlx.core as mx
from mlx_vlm.models.cache import ArraysCache

# id(row view) -> (weak ref to the view, the array it is a row of, its row index);
# an entry leaves with its view.
_VIEWS: dict[int, tuple[weakref.ref, mx.array, int]] = {}


def _stacked_parent(parts: Sequence[mx.array]) -> mx.array | None:
    """The array whose rows ``parts`` are, all of them in order, or ``None``."""
    parent = None
    for index, part in enumerate(parts):
        entry = _VIEWS.get(id(part))
        if entry is None or entry[0]() is not part or entry[2] != index:
            return None
        if parent is None:
            parent = entry[1]
        elif entry[1] is not parent:
            return None
    return parent if parent is not None and parent.shape[0] == len(parts) else None


def stack_rows(parts: Sequence[mx.array]) -> mx.array:
    """``parts`` (each ``[b_i, ...]``) as one ``[sum b_i, ...]`` array; one part as it is,
    and every row of one array, in order, as that array."""
    if len(parts) == 1:
        return parts[0]
    parent = _stacked_parent(parts)
    return parent if parent is not None else mx.concatenate(list(parts))


def take_row(array: mx.array, index: int) -> mx.array:
    """Row ``index`` of ``[B, ...]`` ``array`` as ``[1, ...]``; a one-row array as it is."""
    if array.shape[0] == 1:
        return array
    row = array[index : index + 1]
    key = id(row)
    # The entry leaves with its view (a weak reference's callback: half the cost of
    # a ``weakref.finalize``, taken for every row of every batched state each step).
    _VIEWS[key] = (weakref.ref(row, lambda _, key=key: _VIEWS.pop(key, None)), array, index)
    return row


def take_rows(array: mx.array, indices: Sequence[int]) -> mx.array:
    """Rows ``indices`` (ascending) of ``[B, ...]`` ``array``; all of them as it is."""
    if len(indices) == array.shape[0]:
        return array
    return stack_rows([take_row(array, i) for i in indices])


class SharedRows:
    """The ``[B, ...]`` arrays of one batched step, shared by its ``B`` rows until one is
    read on its own (no slice per row and array in the steady case)."""

    __slots__ = ("arrays", "rows")

    def __init__(self, arrays: Sequence[mx.array | None], rows: int):
        self.arrays, self.rows = tuple(arrays), rows


class RowArraysCache(ArraysCache):
    """mlx-lm's ``ArraysCache`` that may hold row ``i`` of a :class:`SharedRows` instead of
    arrays of its own (:meth:`share`); reading ``cache`` (``c[0]``, ``state``) takes the
    row's slices then. The same arrays and values as an ``ArraysCache`` given the rows."""

    _shared: SharedRows | None = None
    _row = 0

    @property  # type: ignore[override]
    def cache(self) -> list[mx.array | None]:
        shared = self._shared
        if shared is not None:
            self._shared = None
            self._cache = [None if a is None else take_row(a, self._row) for a in shared.arrays]
        return self._cache

    @cache.setter
    def cache(self, value: list[mx.array | None]) -> None:
        self._shared = None
        self._cache = value

    def share(self, shared: SharedRows, row: int) -> None:
        """Hold row ``row`` of ``shared`` (a one-row batch: its arrays themselves)."""
        if shared.rows == 1:
            self.cache = list(shared.arrays)
        else:
            self._shared, self._row = shared, row

    def filled(self) -> bool:
        """Every slot holds an array (read without taking a row's slices)."""
        arrays = self._shared.arrays if self._shared is not None else self._cache
        return all(a is not None for a in arrays)

    @property
    def state_nbytes(self) -> int:
        """The bytes of ``state`` (a shared row as its share of the batch's arrays)."""
        if self._shared is not None:
            return sum(a.nbytes for a in self._shared.arrays if a is not None) // self._shared.rows
        return sum(a.nbytes for a in self._cache if a is not None)


def shared_arrays(caches: Sequence[Any]) -> tuple[mx.array | None, ...] | None:
    """The batch arrays when ``caches`` are every row of one :class:`SharedRows`, in order."""
    first = getattr(caches[0], "_shared", None)
    if first is None or first.rows != len(caches):
        return None
    for row, cache in enumerate(caches):
        if cache._shared is not first or cache._row != row:
            return None
    return first.arrays
