"""A bounded attention context: the prompt's positions (a sink) plus a recent window, in a ring.

Unbounded, an attention layer's KV cache holds every position of the
conversation, so state and per-frame attention grow with it. Bounded, a
layer keeps the first ``keep`` positions (the prompt: the system prompt on
the LLM, the speaker prompt and the system prompt's frames on the EAR-TTS
backbone, so the prompt keeps steering the model) and the most recent
``recent`` positions after them. That is mlx-lm's
``RotatingKVCache(max_size=keep + recent, keep=keep)``; :class:`ContextCache`
is it as a :class:`~.kv_arena.RingCache`: allocated 256 positions at a time as
it fills (whole once full, or once sessions stepping together share an
arena), so a session's memory grows with what it wrote up to the ring and is
constant from then on.

Exactness: until the ring is full (``offset <= keep + recent``) a ring
returns the same keys and values, in the same order, as a growing
``KVCache`` (slices ``[:offset]`` of its buffer), so attention over it is
bit-identical; the tests check ids and codes against the unbounded path.
Once full, each new position overwrites the oldest non-sink one and the ring
is read whole, in ring order (one query attends to every position it holds;
no mask is needed). Positions are absolute: ``offset`` keeps counting, and
RoPE (the EAR-TTS backbone's) rotates at it, so query-key distances stay
the true ones across the wrap. The Nemotron-H attention layers take no RoPE
(the Mamba2 layers carry the order).

A sliding-window layer (the backbone's local layers, window ``S``) keeps its
own rule inside the bounded context: it keeps whichever ring is smaller, its
own ring of ``S`` (a ``RingCache(S)``, ``RotatingKVCache(S)``'s rule: it already drops the prompt) when
``S < keep + recent``, else the bounded ring (its own rule never reaches
inside the context then). Either way it is unchanged until the context is
full.

``state`` / ``meta_state`` are mlx-lm's (:mod:`.cache_state`): before the
wrap the rows written so far, after it the whole ring and its write index,
so a restored ring continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from mlx_vlm.models.cache import KVCache, RotatingKVCache

from ..kv_arena import RingCache


@dataclass(frozen=True)
class ContextWindow:
    """One stack's bounded context: ``keep`` sink positions and ``recent`` positions after."""

    keep: int
    recent: int

    @property
    def size(self) -> int:
        """Positions a full ring holds."""
        return self.keep + self.recent


class ContextCache(RingCache):
    """``RotatingKVCache(keep + recent, keep)`` as a :class:`~.kv_arena.RingCache` (allocated
    as it fills; sessions stepping together share one write)."""

    def __init__(self, window: ContextWindow):
        super().__init__(max_size=window.size, keep=window.keep)


def bound(cache: Any, window: ContextWindow, sliding: int | None = None) -> Any:
    """``cache`` (a layer's ``KVCache`` or sliding ``RotatingKVCache``, holding at most
    ``window.keep`` positions) continued in a bounded context: a ring over its rows."""
    if sliding is not None and sliding < window.size:
        # The layer's own window is the smaller ring: the same ring, as a RingCache.
        if type(cache) is RotatingKVCache and cache.max_size == sliding:
            return RingCache.from_state(cache.state, cache.meta_state)
        return cache
    if not isinstance(cache, (KVCache, RotatingKVCache)):
        raise TypeError(f"cannot bound a {type(cache).__name__}")
    if cache.offset > window.keep:
        raise ValueError(f"a cache at offset {cache.offset} is past the context's "
                         f"{window.keep} kept positions")
    if isinstance(cache, RotatingKVCache) and cache.offset > cache.max_size:
        raise ValueError("a wrapped sliding cache cannot be bounded")
    bounded = ContextCache(window)
    if cache.keys is not None:
        bounded.state = cache.state
        # (keep, max_size, offset, write index): the next write lands after the rows.
        bounded.meta_state = (window.keep, window.size, cache.offset, cache.offset)
    return bounded


def window_capacity(window: ContextWindow | None, sliding: int | None, positions: int) -> int:
    """Positions a layer's cache holds at most over ``positions`` positions in all."""
    held = positions if window is None else min(positions, window.size)
    return held if sliding is None else min(held, sliding)


def bound_all(caches: Sequence[Any], window: ContextWindow,
              sliding: Sequence[int | None]) -> list[Any]:
    """:func:`bound` per layer (``sliding[i]``: layer ``i``'s own window, ``None`` if global)."""
    if len(caches) != len(sliding):
        raise ValueError(f"{len(caches)} caches but {len(sliding)} layer windows")
    return [bound(c, window, s) for c, s in zip(caches, sliding)]
