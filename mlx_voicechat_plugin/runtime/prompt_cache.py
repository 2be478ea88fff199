"""Conversation states after a system-prompt prefill, kept so a repeated prompt starts at once.

The state after prefill is a pure function of (model, prompt token ids, seed):
the prefill reads the tokens with the language heads muted and the EAR-TTS
sampling from the seed's stream. :class:`PromptCache` keeps such states, as
``state`` / ``meta_state`` pairs (mlx-lm's round trip), in an LRU bounded in
bytes and hands out copies (new array handles over the same values: the
caches rebuilt from them write in place), so a session started from it
produces the same ids and codes as one that prefilled.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Hashable

import mlx.core as mx

from ..models.cache_state import copy_arrays
from .options import check_count

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 2**20

Snapshot = tuple[list[mx.array], Any]  # (state, meta_state)


def state_bytes(snapshot: Snapshot) -> int:
    """Bytes of a snapshot's arrays."""
    return sum(a.nbytes for a in snapshot[0])


class PromptCache:
    """LRU of prefilled ``(state, meta_state)`` snapshots, at most ``max_bytes`` of arrays
    in all (0 disables it)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = check_count(max_bytes, "max_bytes")
        self.bytes = 0
        self._entries: OrderedDict[Hashable, tuple[Snapshot, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Snapshot | None:
        """A private copy of the snapshot stored under ``key``, or ``None``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        logger.debug("prompt cache hit (%d entries, %d bytes)", len(self._entries), self.bytes)
        state, meta_state = entry[0]
        return copy_arrays(state), meta_state

    def put(self, key: Hashable, snapshot: Snapshot) -> bool:
        """Store a copy of ``(state, meta_state)`` (evaluated); ``False`` if it alone
        exceeds the budget."""
        stored = (copy_arrays(snapshot[0]), snapshot[1])
        size = state_bytes(stored)
        if size > self.max_bytes:
            return False
        mx.eval(stored[0])
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

