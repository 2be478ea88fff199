"""Rows of batched state: stacking streams' arrays into ``[B, ...]`` and taking one back out.

A stage's state object (mlx-lm's cache convention: ``merge`` then ``extract``)
stacks its streams' arrays on the first axis and hands each row back. One
stream is the ``B = 1`` case of the same code, where both move no data: a
single part is used as it is and a one-row array is its own row.

A pool's batch holds its members' states stacked between frames (the
timeline's language rows, the codec's ``CodecRows``, the listening half's
``PerceptionRows`` and ``RNNTCarry``), so a steady frame stacks and slices
nothing; these helpers run when the batch forms or changes. A frame's
outputs go from one stage to the next as whole ``[B, ...]`` arrays, each
stage taking the rows it runs (:func:`take_rows`: all of them, the array as
it is).
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


def own_row(array: mx.array, index: int, copy: bool = True) -> mx.array:
    """Row ``index`` of ``[B, ...]`` ``array`` as ``[1, ...]`` in a buffer of its own (a
    copy, made when evaluated), for a row a batch gives back: a slice would keep the
    batch's whole buffer alive for as long as the row is kept; a one-row array as it is.
    ``copy=False``: the slice, for a row stacked again at once."""
    row = take_row(array, index)
    return row if row is array or not copy else mx.contiguous(row)


def take_rows(array: mx.array, indices: Sequence[int]) -> mx.array:
    """Rows ``indices`` (ascending) of ``[B, ...]`` ``array``; all of them as it is."""
    if len(indices) == array.shape[0]:
        return array
    return stack_rows([take_row(array, i) for i in indices])
