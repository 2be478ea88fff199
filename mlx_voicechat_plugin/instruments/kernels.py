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

:func:`host_ms` measures the other cost of a frame on a GPU: the stepping
thread's CPU time, where every graph node (views included, :attr:`~KernelCounter.nodes`)
costs a dispatch; :func:`thread_waits` how often that thread blocked (on MLX's
CPU backend, mostly the evaluation's throttle: the stepping thread is held
back whenever more than ten tasks of ten dispatches each are queued on the
compute thread, so it stays about fifty graph nodes ahead of the compute and
pays a block and a wake-up about every five nodes, which a GPU backend,
whose task is a command buffer of about a hundred operations, does not).

Nothing is patched outside the ``with`` block, so normal runs pay nothing.
Used by ``python -m bench.kernels`` (per pool step, per batch size) and by
``tests/test_kernel_counter.py``, which shows it counts what happened.
"""

from __future__ import annotations

import io
import re
import time
from collections import Counter
from typing import Any, Callable

import mlx.core as mx

from .eval_patch import EvalPatch, array_leaves

# Primitives that are views or no-ops (no kernel on any backend), by DOT label.
VIEWS = frozenset({
    "Reshape", "Transpose", "Slice", "Broadcast", "BroadcastAxes", "ExpandDims", "Squeeze",
    "AsStrided", "Split", "Flatten", "Unflatten", "StopGradient", "Depends",
})

_NODE = re.compile(r'^\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}$', re.M)


def graph_primitives(*arrays: Any) -> Counter:
    """The primitives (views included) still to be evaluated for ``arrays``, by name."""
    leaves = [a for a in array_leaves(arrays)]
    if not leaves:
        return Counter()
    buffer = io.StringIO()
    mx.export_to_dot(buffer, *leaves)
    return Counter(name for _, name in _NODE.findall(buffer.getvalue()))


def host_ms(run: Callable[[], Any]) -> float:
    """The calling thread's CPU milliseconds in ``run()``: Python, graph building and
    dispatch (MLX computes on its own threads, and waiting costs no CPU), the host
    work a GPU frame has as a floor. Absolute values move with the machine's load:
    compare them as ratios taken in one run."""
    began = time.thread_time()
    run()
    return (time.thread_time() - began) * 1e3


def thread_waits() -> int | None:
    """How many times the calling thread has blocked so far (its voluntary context
    switches), or ``None`` where the system does not count them per thread (Linux
    does; macOS has no ``RUSAGE_THREAD``). Take the difference around a step."""
    try:
        import resource
    except ImportError:  # no getrusage on this system
        return None
    who = getattr(resource, "RUSAGE_THREAD", None)
    return None if who is None else resource.getrusage(who).ru_nvcsw


def host_work(run: Callable[[], Any]) -> tuple[float, int | None]:
    """:func:`host_ms` of ``run()`` and the :func:`thread_waits` it added (``None`` where
    not counted)."""
    before = thread_waits()
    ms = host_ms(run)
    return ms, None if before is None else thread_waits() - before


def kernel_count(primitives: Counter) -> int:
    """How many of ``primitives`` launch a kernel (views excluded)."""
    return sum(n for name, n in primitives.items() if name not in VIEWS)


class KernelCounter(EvalPatch):
    """Context manager: counts evaluated primitives and evaluations on this thread.

    ``primitives`` (a :class:`~collections.Counter` by name, views included),
    ``kernels`` (views excluded) and ``evaluations`` accumulate until
    :meth:`reset`; ``calls`` lists what each evaluation was.
    """

    def __init__(self) -> None:
        super().__init__()
        self.primitives: Counter = Counter()
        self.evaluations = 0
        self.calls: list[str] = []
        self.per_call: list[int] = []  # kernels of each evaluation, in order

    @property
    def kernels(self) -> int:
        return kernel_count(self.primitives)

    @property
    def nodes(self) -> int:
        """Every evaluated graph node, views included (each costs the host a dispatch)."""
        return sum(self.primitives.values())

    @property
    def views(self) -> int:
        return self.nodes - self.kernels

    def reset(self) -> None:
        self.primitives = Counter()
        self.evaluations = 0
        self.calls = []
        self.per_call = []

    def snapshot(self) -> dict[str, Any]:
        """Counts so far, as plain values."""
        return {"kernels": self.kernels, "nodes": self.nodes, "evaluations": self.evaluations,
                "matmuls": self.primitives.get("Matmul", 0) + self.primitives.get("AddMM", 0)
                + self.primitives.get("QuantizedMatmul", 0),
                "calls": list(self.calls), "per_call": list(self.per_call)}

    # --- counting ----------------------------------------------------------

    def _count(self, what: str, arrays: Any) -> None:
        found = graph_primitives(arrays)
        if sum(found.values()):
            self.primitives.update(found)
            self.evaluations += 1
            self.calls.append(what)
            self.per_call.append(kernel_count(found))

    def _wrap_eval(self, original: Callable) -> Callable:
        return self._counted("eval", original, original)

    def _wrap_async_eval(self, original: Callable) -> Callable:
        # async_eval is synchronous while counting (its graph is counted as it evaluates)
        return self._counted("async_eval", original, self._original(mx, "eval"))

    def _counted(self, what: str, original: Callable, evaluate: Callable) -> Callable:
        def counted(*args: Any) -> Any:
            if not self._mine():
                return original(*args)
            self._count(what, args)
            return evaluate(*args)

        return counted

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


class EvaluationTime(EvalPatch):
    """Context manager: the entering thread's CPU time and blocks inside the entry points
    that evaluate a graph (``mx.eval``, ``mx.async_eval``, the host reads), so a step's
    :func:`host_ms` splits into evaluation (MLX's graph walk, its allocations, its
    dispatch and, on the CPU backend, the throttle's wake-ups: work that grows with what
    the compute thread has to do) and the rest (Python, building the graph, the books).
    ``ms`` and ``waits`` accumulate until :meth:`reset`; ``calls`` counts the entries."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.ms, self.waits, self.calls = 0.0, 0, 0

    def _timed(self, original: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._mine():
                return original(*args, **kwargs)
            blocked, began = thread_waits(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.ms += (time.thread_time() - began) * 1e3
                if blocked is not None:
                    self.waits += thread_waits() - blocked
                self.calls += 1

        return timed

    def _wrap_eval(self, original: Callable) -> Callable:
        return self._timed(original)

    def _wrap_async_eval(self, original: Callable) -> Callable:
        return self._timed(original)

    def _wrap_method(self, name: str) -> Callable[[Callable], Callable]:
        return self._timed

    def _wrap_numpy(self, name: str) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            timed = self._timed(original)

            def read(value: Any = None, *args: Any, **kwargs: Any) -> Any:
                if isinstance(value, mx.array):
                    return timed(value, *args, **kwargs)
                return original(value, *args, **kwargs)

            return read

        return make
