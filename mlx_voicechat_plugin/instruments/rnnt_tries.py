"""Counting the RNNT's tries a step runs: the transcript work a batch's rows share.

A frame's greedy decoding runs the first try of every row, then, when any
row's first try emitted a symbol, the other ``max_symbols - 1`` tries of every
row in one fixed-shape graph (:class:`~..models.rnnt.RNNTFrame`, rows that did
not emit masked). That second graph is a few hundred kernels at any batch
size, so a step that runs it costs more than one that does not, whatever N
is: two steps compare like for like only when both ran it or neither did.
:class:`RNNTTries` counts the graphs queued while active, by number of
tries, on the entering thread: ``first`` (one try) and ``later`` (more).
Nothing is patched outside the ``with`` block. Used by ``python -m
bench.kernels`` (how many counted steps ran the later tries, per N) and by
``tests/test_kernel_counter.py``.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from ..models.rnnt.rnnt import GreedyRNNT


class RNNTTries:
    """Context manager: the greedy graphs queued on the entering thread, by tries
    (``by_tries``), with ``first`` and ``later`` read from it."""

    def __init__(self) -> None:
        self.by_tries: Counter = Counter()
        self._thread: int | None = None
        self._original: Any = None

    @property
    def first(self) -> int:
        return self.by_tries[1]

    @property
    def later(self) -> int:
        return sum(n for tries, n in self.by_tries.items() if tries > 1)

    def __enter__(self) -> "RNNTTries":
        if self._original is not None:
            raise RuntimeError("RNNTTries is already active")
        self._thread, self._original = threading.get_ident(), GreedyRNNT.__call__
        original, counter = self._original, self

        def counted(greedy: GreedyRNNT, encoded: Any, carry: Any, tries: int,
                    active: Any = None) -> Any:
            if threading.get_ident() == counter._thread:
                counter.by_tries[tries] += 1
            return original(greedy, encoded, carry, tries, active)

        GreedyRNNT.__call__ = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        GreedyRNNT.__call__ = self._original  # type: ignore[method-assign]
        self._original = None
