"""Watching what evaluates an MLX graph on one thread: the shared part of the counters.

MLX evaluates a graph in ``mx.eval`` and ``mx.async_eval``, and implicitly
when the host reads an array: ``item``, ``tolist``, ``bool``/``int``/``float``
of it, ``np.array``/``np.asarray`` over it. :class:`EvalPatch` replaces those
entry points with a subclass's wrappers on entering its ``with`` block and
puts the originals back on leaving it, so a run outside the block pays
nothing. A wrapper acts only for calls from the thread that entered
(:meth:`EvalPatch._mine`); one instance of each subclass may be active at a
time (a wrapper names the instrument that installed it, :func:`patched_by`:
what is active is read from the entry points themselves, not kept aside). Subclasses: :class:`~.syncs.HostSyncCounter` (host round trips) and
:class:`~.kernels.KernelCounter` (primitives a GPU would launch).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import mlx.core as mx
import numpy as np

ARRAY_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__")
NUMPY_FUNCTIONS = ("array", "asarray")

Wrap = Callable[[Callable], Callable]  # original -> its wrapper

PATCHED_BY = "_voicechat_patched_by"  # a wrapper's attribute: the instrument that installed it

_lock = threading.Lock()  # one instrument at a time checks and patches


def patched_by(entry: Callable, kind: type) -> bool:
    """Whether an instrument of type ``kind`` wrapped ``entry`` (at any depth of wrapping:
    each wrapper names its instrument and the entry point it wraps)."""
    while entry is not None:
        owner = getattr(entry, PATCHED_BY, None)
        if owner is None:
            return False
        if type(owner) is kind:
            return True
        entry = getattr(entry, "__wrapped__", None)
    return False


def install(owner: Any, name: str, wrapper: Callable, instrument: Any) -> Callable:
    """Put ``wrapper`` in place of ``owner.name``, marked as ``instrument``'s; returns the
    original."""
    original = getattr(owner, name)
    setattr(wrapper, PATCHED_BY, instrument)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
    return original


class EvalPatch:
    """Context manager installing :meth:`_wrap_eval`, :meth:`_wrap_async_eval`,
    :meth:`_wrap_method` and :meth:`_wrap_numpy` while active."""

    def __init__(self) -> None:
        self._thread = 0
        self._saved: dict[tuple[Any, str], Callable] = {}

    def __enter__(self):
        kind = type(self)
        with _lock:
            if patched_by(mx.eval, kind):
                raise RuntimeError(f"a {kind.__name__} is already active")
            self._thread = threading.get_ident()
            self._patch(mx, "eval", self._wrap_eval)
            self._patch(mx, "async_eval", self._wrap_async_eval)
            for name in ARRAY_METHODS:
                self._patch(mx.array, name, self._wrap_method(name))
            for name in NUMPY_FUNCTIONS:
                self._patch(np, name, self._wrap_numpy(name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)
        self._saved.clear()
        self._closed()

    def _patch(self, owner: Any, name: str, make: Wrap) -> None:
        original = getattr(owner, name)
        self._saved[(owner, name)] = install(owner, name, make(original), self)

    def _original(self, owner: Any, name: str) -> Callable:
        """The entry point as it was before this patch (while active)."""
        return self._saved[(owner, name)]

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    # --- for subclasses ------------------------------------------------------

    def _closed(self) -> None:
        """Called on leaving the block, after the originals are back."""

    def _wrap_eval(self, original: Callable) -> Callable:
        raise NotImplementedError

    def _wrap_async_eval(self, original: Callable) -> Callable:
        raise NotImplementedError

    def _wrap_method(self, name: str) -> Wrap:
        raise NotImplementedError

    def _wrap_numpy(self, name: str) -> Wrap:
        raise NotImplementedError


def array_leaves(values: Any):
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
