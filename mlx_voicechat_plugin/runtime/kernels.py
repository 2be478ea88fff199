"""Counting the kernels a step launches: MLX primitives and evaluations, on any backend.

At small batch a GPU frame costs about one kernel launch per evaluated MLX
primitive, whatever the matrix sizes, so the number of primitives a step
evaluates predicts its GPU time where no GPU is at hand. :class:`KernelCounter`
counts them on the CPU: while it is active it wraps every entry point that
evaluates a graph (``mx.eval``, ``mx.async_eval``, ``array.item`` /
``tolist`` / ``bool`` / ``int`` / ``float``, ``np.array`` / ``np.asarray`` of
an ``mx.array``), and before each one runs it writes the graph still to be
evaluated with ``mx.export_to_dot`` and counts its primitive nodes by name.

- Views (:data:`VIEWS`: reshape, transpose, slice, broadcast, expand_dims,
  squeeze, as_strided, split, ...) are not counted: they launch nothing.
- A call to an ``mx.compile``'d function shows up as the primitives of its
  simplified graph, where each fused elementwise chain is one ``Compiled...``
  node: a chain counts once per call, as it launches once.
- An evaluation is an entry point that found work to do (a graph with at
  least one primitive); reading an array already evaluated is not one.
- ``mx.async_eval`` is made synchronous while counting (it is exported,
  then evaluated at once), so no later export sees a graph counted before.
  The counter is a measuring instrument: it changes timing, never results.

Nothing is patched outside the ``with`` block, so normal runs pay nothing.
Used by ``python -m bench.kernels`` (per pool step, per batch size) and by
``tests/test_kernel_counter.py``, which shows it counts what happened.
"""

from __future__ import annotations

import io
import re
import threading
from collections import Counter
from typing import Any, Callable

import mlx.core as mx
import numpy as np

# Primitives that are views or no-ops (no kernel on any backend), by DOT label.
VIEWS = frozenset({
    "Reshape", "Transpose", "Slice", "Broadcast", "BroadcastAxes", "ExpandDims", "Squeeze",
    "AsStrided", "Split", "Flatten", "Unflatten", "StopGradient", "Depends",
})

_NODE = re.compile(r'^\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}$', re.M)
_ARRAY_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__")


def graph_primitives(*arrays: Any) -> Counter:
    """The primitives (views included) still to be evaluated for ``arrays``, by name."""
    leaves = [a for a in _flatten(arrays)]
    if not leaves:
        return Counter()
    buffer = io.StringIO()
    mx.export_to_dot(buffer, *leaves)
    return Counter(name for _, name in _NODE.findall(buffer.getvalue()))


def kernel_count(primitives: Counter) -> int:
    """How many of ``primitives`` launch a kernel (views excluded)."""
    return sum(n for name, n in primitives.items() if name not in VIEWS)


class KernelCounter:
    """Context manager: counts evaluated primitives and evaluations on this thread.

    ``primitives`` (a :class:`~collections.Counter` by name, views included),
    ``kernels`` (views excluded) and ``evaluations`` accumulate until
    :meth:`reset`; ``calls`` lists what each evaluation was.
    """

    _lock = threading.Lock()
    _active: "KernelCounter | None" = None

    def __init__(self) -> None:
        self.primitives: Counter = Counter()
        self.evaluations = 0
        self.calls: list[str] = []
        self.per_call: list[int] = []  # kernels of each evaluation, in order
        self._thread = 0
        self._saved: dict[tuple[Any, str], Callable] = {}

    @property
    def kernels(self) -> int:
        return kernel_count(self.primitives)

    def reset(self) -> None:
        self.primitives = Counter()
        self.evaluations = 0
        self.calls = []
        self.per_call = []

    def snapshot(self) -> dict[str, Any]:
        """Counts so far, as plain values."""
        return {"kernels": self.kernels, "evaluations": self.evaluations,
                "matmuls": self.primitives.get("Matmul", 0) + self.primitives.get("AddMM", 0)
                + self.primitives.get("QuantizedMatmul", 0),
                "calls": list(self.calls), "per_call": list(self.per_call)}

    # --- install / uninstall ---------------------------------------------

    def __enter__(self) -> "KernelCounter":
        with KernelCounter._lock:
            if KernelCounter._active is not None:
                raise RuntimeError("a KernelCounter is already active")
            KernelCounter._active = self
        self._thread = threading.get_ident()
        self._patch(mx, "eval", self._wrap_eval("eval"))
        self._patch(mx, "async_eval", self._wrap_eval("async_eval"))
        for name in _ARRAY_METHODS:
            self._patch(mx.array, name, self._wrap_method(name))
        for name in ("array", "asarray"):
            self._patch(np, name, self._wrap_numpy(name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)
        self._saved.clear()
        with KernelCounter._lock:
            KernelCounter._active = None

    def _patch(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        self._saved[(owner, name)] = original
        setattr(owner, name, make(original))

    # --- counting ----------------------------------------------------------

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    def _count(self, what: str, arrays: Any) -> None:
        found = graph_primitives(arrays)
        if sum(found.values()):
            self.primitives.update(found)
            self.evaluations += 1
            self.calls.append(what)
            self.per_call.append(kernel_count(found))

    def _wrap_eval(self, what: str) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            evaluate = self._saved[(mx, "eval")] if what == "async_eval" else original

            def counted(*args: Any) -> Any:
                if not self._mine():
                    return original(*args)
                self._count(what, args)
                return evaluate(*args)  # async_eval: synchronous while counting

            return counted

        return make

    def _wrap_method(self, name: str) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            def counted(array: mx.array, *args: Any) -> Any:
                if self._mine():
                    self._count(name, array)
                return original(array, *args)

            return counted

        return make

    def _wrap_numpy(self, name: str) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            def counted(value: Any = None, *args: Any, **kwargs: Any) -> Any:
                if self._mine() and isinstance(value, mx.array):
                    self._count(f"np.{name}", value)
                return original(value, *args, **kwargs)

            return counted

        return make


def _flatten(values: Any):
    """The ``mx.array`` leaves of eval's arguments (arrays, lists, tuples, dicts)."""
    stack = [values]
    while stack:
        value = stack.pop()
        if isinstance(value, mx.array):
            yield value
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
