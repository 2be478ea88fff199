"""A per-session random stream.

``mx.random.seed(s)`` followed by key-less draws is the same as drawing with
``split(key(s))[1]`` and carrying ``split(...)[0]`` forward, so a session that
owns its key reproduces the reference's seeded sequence exactly while staying
isolated from any other session on the same model.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from ..quoting import brief


def _splits(count: int):
    """``count`` successive splits: ``key -> (next key, [count, 2] draw keys)``."""

    def run(key: mx.array) -> tuple[mx.array, mx.array]:
        subs = []
        for _ in range(count):
            key, sub = mx.random.split(key)
            subs.append(sub)
        return key, mx.stack(subs)

    return run


@lru_cache(maxsize=None)
def _chain(count: int):
    """Compiled :func:`_splits` of one key."""
    return mx.compile(_splits(count))


@lru_cache(maxsize=None)
def _chains(count: int):
    """Compiled :func:`_splits` of ``[B, 2]`` keys, one chain per row (``vmap``: one
    random-bits kernel per split for every row, each row's bits its key's own)."""
    return mx.compile(mx.vmap(_splits(count)))


MAX_SEED = 2**64 - 1  # mx.random.key takes an unsigned 64-bit seed


def check_seed(seed: object, what: str = "seed") -> int:
    """The one seed rule: an integer in ``[0, 2**64 - 1]`` (``ValueError`` naming ``what``)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{what} must be an integer from 0 to 2**64 - 1, got {brief(seed)}")
    return seed


class HeldKeys:
    """The keys of streams advanced together (:meth:`RandomStream.take_many`), kept
    stacked ``[B, 2]`` between draws: while the same streams draw together, each draw
    reads and replaces this one array, and a stream's ``key`` is its row of it."""

    def __init__(self, streams: list["RandomStream"]):
        self.streams = streams
        self.keys = mx.stack([s.key for s in streams])
        for row, stream in enumerate(streams):
            stream._key, stream._held = None, (self, row)  # the stack is its only copy

    def holds(self, streams: list["RandomStream"]) -> bool:
        """Exactly these streams, in this order, none advanced on its own since."""
        return len(streams) == len(self.streams) and all(
            s is t and s._held is not None and s._held[0] is self
            for s, t in zip(streams, self.streams))


class RandomStream:
    """One session's key, advanced by every draw; ``state`` is ``[key]`` (mlx-lm's convention)."""

    def __init__(self, seed: int):
        self.key: mx.array | None = mx.random.key(check_seed(seed))

    @property
    def key(self) -> mx.array | None:
        """Its key: its own, or its row of the keys it draws with others (:class:`HeldKeys`)."""
        if self._held is not None:
            held, row = self._held
            return held.keys[row]
        return self._key

    @key.setter
    def key(self, value: mx.array | None) -> None:
        self._key, self._held = value, None

    @property
    def state(self) -> list[mx.array]:
        key = self.key
        return [] if key is None else [key]

    @state.setter
    def state(self, value: list[mx.array]) -> None:
        (self.key,) = value if value else (None,)

    @classmethod
    def from_state(cls, state: list[mx.array]) -> "RandomStream":
        stream = cls.__new__(cls)
        stream.state = state
        return stream

    def next(self) -> mx.array:
        """The key for the next draw."""
        self.key, sub = mx.random.split(self.key)
        return sub

    def take(self, count: int) -> mx.array:
        """The keys of the next ``count`` draws, stacked ``[count, 2]`` (same as ``next`` each)."""
        self.key, keys = _chain(count)(self.key)
        return keys

    @staticmethod
    def take_many(streams: list["RandomStream"], count: int) -> mx.array:
        """:meth:`take` of every stream, ``[B, count, 2]``, as one computation for all of
        them (each stream's keys and its next key equal its own :meth:`take`). The
        streams' keys stay stacked until one of them draws alone or with others."""
        if len(streams) == 1:
            return streams[0].take(count)[None]
        first = streams[0]._held
        held = first[0] if first is not None and first[0].holds(streams) else HeldKeys(streams)
        held.keys, subs = _chains(count)(held.keys)
        return subs
