"""A per-session random stream.

``mx.random.seed(s)`` followed by key-less draws is the same as drawing with
``split(key(s))[1]`` and carrying ``split(...)[0]`` forward, so a session that
owns its key reproduces the reference's seeded sequence exactly while staying
isolated from any other session on the same model.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx


@lru_cache(maxsize=None)
def _chain(count: int):
    """Compiled ``count`` successive splits: ``key -> (next key, [count, 2] draw keys)``."""

    def run(key: mx.array) -> tuple[mx.array, mx.array]:
        subs = []
        for _ in range(count):
            key, sub = mx.random.split(key)
            subs.append(sub)
        return key, mx.stack(subs)

    return mx.compile(run)


class RandomStream:
    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self._key = mx.random.key(seed)

    def next(self) -> mx.array:
        """The key for the next draw."""
        self._key, sub = mx.random.split(self._key)
        return sub

    def take(self, count: int) -> mx.array:
        """The keys of the next ``count`` draws, stacked ``[count, 2]`` (same as ``next`` each)."""
        self._key, keys = _chain(count)(self._key)
        return keys
