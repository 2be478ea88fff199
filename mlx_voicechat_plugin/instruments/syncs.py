"""Counting host synchronisations: the points where Python waits for MLX.

A host sync is any call that materialises an array on the host, so that
Python waits for the device: ``mx.eval`` with arrays, ``array.item()``,
``array.tolist()``, ``bool/int/float(array)`` and numpy conversion
(``np.array`` / ``np.asarray``) of an ``mx.array``. Reading an array that an
``mx.eval`` in the same window already returned does not wait again and is
not counted; ``mx.async_eval`` does not wait by contract, but on the CPU
backend it runs much of the work before returning, so its time is recorded
(``async_eval_ms``) next to the time spent waiting in counted syncs
(``wait_ms``).

:class:`HostSyncCounter` wraps those entry points while it is active, on the
thread that entered it only (the server's event loop keeps its own numpy).
The profile uses it per frame; tests use it to show a frame makes exactly the
syncs it should. It counts what happened, nothing is declared by the caller.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import mlx.core as mx

from .eval_patch import EvalPatch, array_leaves


class HostSyncCounter(EvalPatch):
    """Context manager: counts host syncs on the current thread while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.wait_ms = 0.0
        self.async_eval_ms = 0.0
        self.calls: list[str] = []  # what each counted sync was, in order
        self._evaluated: dict[int, mx.array] = {}  # id -> array, kept alive

    def reset(self) -> None:
        self.count = 0
        self.wait_ms = self.async_eval_ms = 0.0
        self.calls = []
        self._evaluated.clear()

    def _closed(self) -> None:
        self._evaluated.clear()

    # --- bookkeeping -----------------------------------------------------

    def _timed(self, what: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return call()
        finally:
            self.wait_ms += (time.perf_counter() - start) * 1e3
            self.count += 1
            self.calls.append(what)

    def _remember(self, arrays: tuple[Any, ...]) -> None:
        for value in array_leaves(arrays):
            self._evaluated[id(value)] = value

    def _is_evaluated(self, value: Any) -> bool:
        return self._evaluated.get(id(value)) is value

    # --- wrappers --------------------------------------------------------

    def _wrap_eval(self, original: Callable) -> Callable:
        def counted_eval(*args: Any) -> Any:
            if not self._mine() or not any(True for _ in array_leaves(args)):
                return original(*args)
            result = self._timed("eval", lambda: original(*args))
            self._remember(args)
            return result

        return counted_eval

    def _wrap_async_eval(self, original: Callable) -> Callable:
        def timed_async_eval(*args: Any) -> Any:
            if not self._mine():
                return original(*args)
            start = time.perf_counter()
            try:
                return original(*args)
            finally:
                self.async_eval_ms += (time.perf_counter() - start) * 1e3

        return timed_async_eval

    def _wrap_method(self, name: str) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            def counted(array: mx.array, *args: Any) -> Any:
                if not self._mine() or self._is_evaluated(array):
                    return original(array, *args)
                return self._timed(name, lambda: original(array, *args))

            return counted

        return make

    def _wrap_numpy(self, name: str) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            def counted(value: Any = None, *args: Any, **kwargs: Any) -> Any:
                if not self._mine() or not isinstance(value, mx.array) \
                        or self._is_evaluated(value):
                    return original(value, *args, **kwargs)
                return self._timed(f"np.{name}", lambda: original(value, *args, **kwargs))

            return counted

        return make
