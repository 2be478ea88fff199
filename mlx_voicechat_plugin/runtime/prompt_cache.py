"""Timeline states after a system-prompt prefill, kept so a repeated prompt starts at once.

The state after prefill is a pure function of (model, prompt token ids, seed):
the prefill reads the tokens with the language heads muted and the EAR-TTS
sampling from the seed's stream. :class:`PromptCache` keeps such states in an
LRU bounded in bytes and hands out copies (new cache objects and new array
handles over the same values, see :func:`clone_state`), so a session started
from it produces the same ids and codes as one that prefilled.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from typing import Any, Hashable

import mlx.core as mx

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 2**20


def clone_state(value: Any) -> Any:
    """A copy of a state tree whose arrays are new handles over the same values.

    Lists, tuples and dicts are rebuilt; mlx cache objects are shallow-copied
    with their array and list attributes cloned. KV caches write with slice
    assignment and Mamba caches replace list items: both touch only the copy.
    """
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, list):
        return [clone_state(v) for v in value]
    if isinstance(value, tuple):
        return tuple(clone_state(v) for v in value)
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    if hasattr(value, "__dict__") and type(value).__module__.split(".")[0] in ("mlx_lm", "mlx_vlm"):
        clone = copy.copy(value)
        for name, item in vars(value).items():
            if isinstance(item, (mx.array, list, tuple, dict)):
                setattr(clone, name, clone_state(item))
        return clone
    return value  # ints, None, immutable host values


def state_arrays(value: Any) -> list[mx.array]:
    """Every array in a state tree (for evaluation and sizing)."""
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in state_arrays(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in state_arrays(v)]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return [a for v in vars(value).values() for a in state_arrays(v)]
    return []


def state_bytes(value: Any) -> int:
    return sum(a.nbytes for a in state_arrays(value))


class PromptCache:
    """LRU of prefilled timeline states, at most ``max_bytes`` in all (0 disables it)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a non-negative integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Any | None:
        """A private copy of the state stored under ``key``, or ``None``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        logger.debug("prompt cache hit (%d entries, %d bytes)", len(self._entries), self.bytes)
        return clone_state(entry[0])

    def put(self, key: Hashable, state: Any) -> bool:
        """Store a copy of ``state`` (evaluated); ``False`` if it alone exceeds the budget."""
        stored = clone_state(state)
        size = state_bytes(stored)
        if size > self.max_bytes:
            return False
        mx.eval(state_arrays(stored))
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (stored, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped
                logger.debug("prompt cache evicted %d bytes", dropped)
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0


def prompt_cache_of(model: Any) -> "PromptCache | None":
    """The model's prompt cache: ``model.prompt_cache``, set by ``load`` (or a server's budget)."""
    return getattr(model, "prompt_cache", None)
