"""A per-session random stream.

``mx.random.seed(s)`` followed by key-less draws is the same as drawing with
``split(key(s))[1]`` and carrying ``split(...)[0]`` forward, so a session that
owns its key reproduces the reference's seeded sequence exactly while staying
isolated from any other session on the same model.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from ..models.rows import drop_row, own_row
from ..quoting import brief


@lru_cache(maxsize=None)
def _chain(count: int, rows: bool = False):
    """``count`` successive splits, compiled: ``key -> (next key, [count, 2] draw keys)``
    of one key, or (``rows``) of ``[B, 2]`` keys, one chain per row (``vmap``: one
    random-bits kernel per split for every row, each row's bits its key's own)."""

    def splits(key: mx.array) -> tuple[mx.array, mx.array]:
        subs = []
        for _ in range(count):
            key, sub = mx.random.split(key)
            subs.append(sub)
        return key, mx.stack(subs)

    return mx.compile(mx.vmap(splits) if rows else splits)


MAX_SEED = 2**64 - 1  # mx.random.key takes an unsigned 64-bit seed


def check_seed(seed: object, what: str = "seed") -> int:
    """The one seed rule: an integer in ``[0, 2**64 - 1]`` (``ValueError`` naming ``what``)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{what} must be an integer from 0 to 2**64 - 1, got {brief(seed)}")
    return seed


class KeyRows:
    """The keys of a batch's rows stacked ``[B, 2]``: while a stream is a row here this
    is its key's only copy (its :class:`RandomStream` holds none), and one draw of
    every row is one computation on this array."""

    def __init__(self, keys: mx.array):
        self.keys = keys

    @classmethod
    def merge(cls, parts: list["KeyRows | RandomStream"]) -> "KeyRows":
        """The rows of ``parts`` in order: a stream's key moves here (it keeps none)."""
        keys = []
        for part in parts:
            if isinstance(part, KeyRows):
                keys.append(part.keys)
            else:
                keys.append(part.key[None])
                part.key = None
        return cls(mx.concatenate(keys))

    def __len__(self) -> int:
        return self.keys.shape[0]

    def take(self, count: int) -> mx.array:
        """:meth:`RandomStream.take` of every row, ``[B, count, 2]``, as one computation;
        each row's keys and next key equal its own ``take``."""
        self.keys, subs = _chain(count, rows=True)(self.keys)
        return subs

    def remove(self, index: int) -> mx.array:
        """Row ``index``'s key (a copy); the others stay stacked."""
        key = own_row(self.keys, index)[0]
        self.keys = drop_row(self.keys, index)
        return key


class RandomStream:
    """One session's key, advanced by every draw; ``state`` is ``[key]`` (mlx-lm's convention)."""

    def __init__(self, seed: int):
        self.key: mx.array | None = mx.random.key(check_seed(seed))

    @property
    def state(self) -> list[mx.array]:
        return [] if self.key is None else [self.key]

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
