"""Rows of batched state: stacking streams' arrays into ``[B, ...]`` and taking one back out.

A stage's state object (mlx-lm's cache convention: ``merge`` then ``extract``)
stacks its streams' arrays on the first axis and hands each row back. One
stream is the ``B = 1`` case of the same code, where both move no data: a
single part is used as it is and a one-row array is its own row.

A batch that steps again with the same rows in the same order stacks nothing:
:func:`take_row` remembers which array and row each row view came from, and
:func:`stack_rows` of every row view of one array, in order, is that array
(the same values, so the same bits; no concatenation kernel). A pool that
steps the same sessions frame after frame then re-stacks none of their state.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import mlx.core as mx

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
    _VIEWS[key] = (weakref.ref(row), array, index)
    weakref.finalize(row, _VIEWS.pop, key, None)
    return row


def take_rows(array: mx.array, indices: Sequence[int]) -> mx.array:
    """Rows ``indices`` (ascending) of ``[B, ...]`` ``array``; all of them as it is."""
    if len(indices) == array.shape[0]:
        return array
    return stack_rows([take_row(array, i) for i in indices])
