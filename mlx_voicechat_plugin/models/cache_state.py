"""A list of mlx caches as ``state`` and ``meta_state``, mlx-lm's prompt-cache round trip.

``KVCache``, ``RotatingKVCache`` and ``ArraysCache`` (mlx-lm's and mlx-vlm's)
each give their arrays as ``state`` and their host values as ``meta_state``,
and ``from_state`` rebuilds one (``mlx_lm.models.cache.load_prompt_cache``).
For a list of them :func:`cache_state` is every array in order (a slot not
yet written, ``None``, is left out) and :func:`cache_meta_state` the host
values that put them back: each cache's class, its ``meta_state`` and which
of its slots hold an array. :func:`caches_from_state` rebuilds new cache
objects; a cache writes into its arrays in place (slice assignment), so give
it arrays no other cache holds (``copy_arrays``).

The state of a KV cache is the rows it holds, not its allocation (mlx-lm's
``state`` slices the step-grown buffer to ``offset``); a rebuilt cache grows
again from there and returns the same keys and values from
``update_and_fetch``, so attention over it is bit-identical.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import mlx.core as mx

MetaState = tuple[tuple[type, Any, tuple[bool, ...]], ...]


def cache_state(caches: Sequence[Any]) -> list[mx.array]:
    """Every array the caches hold, in order."""
    return [a for c in caches for a in c.state if a is not None]


def state_nbytes(caches: Sequence[Any]) -> int:
    """The bytes of :func:`cache_state`."""
    return sum(a.nbytes for a in cache_state(caches))


def cache_meta_state(caches: Sequence[Any]) -> MetaState:
    """The host values :func:`caches_from_state` needs with :func:`cache_state`."""
    return tuple((type(c), c.meta_state, tuple(a is not None for a in c.state)) for c in caches)


def caches_from_state(state: Sequence[mx.array], meta_state: MetaState) -> list[Any]:
    """New cache objects over ``state`` (as :func:`cache_state` lists them)."""
    arrays = iter(state)
    caches = [kind.from_state([next(arrays) if p else None for p in present], meta)
              for kind, meta, present in meta_state]
    if next(arrays, None) is not None:
        raise ValueError("cache state has more arrays than its meta_state describes")
    return caches


def copy_arrays(arrays: Sequence[mx.array]) -> list[mx.array]:
    """New array handles over the same values (a cache's writes then touch only its own)."""
    return [mx.array(a) for a in arrays]


def split_state(state: Sequence[mx.array], counts: Sequence[int]) -> list[list[mx.array]]:
    """A flat ``state`` cut into consecutive parts of ``counts`` arrays (a composite's parts)."""
    if len(state) != sum(counts):
        raise ValueError(f"state has {len(state)} arrays, its meta_state describes {sum(counts)}")
    ends = list(itertools.accumulate(counts))
    return [list(state[end - count : end]) for count, end in zip(counts, ends)]
