"""EAR-TTS frames of many independent sessions in one batch, exact per session.

A batch of ``B`` sessions uses the layout the single-session code already has
for ``B`` rows: the guided backbone hidden is ``[cond_0 .. cond_{B-1};
uncond_0 .. uncond_{B-1}]`` (``[2B, 1, dims]``), so session ``b`` owns rows
``b`` and ``B + b`` (:func:`session_rows`).

Exactness contract: row by row, every output is bit-identical to the
single-session call on that session alone, and every session's state (its
backbone caches, its key stream) ends exactly where the single call leaves
it, so single and batched frames may follow each other in any order. This
holds because

- every fixed-shape op (linears, norms, MLPs, embeddings, the MoG networks,
  the RVQ distances) runs once over all rows, and those ops are row-wise
  exact on MLX's CPU backend (a row's result does not depend on the other
  rows of the batch);
- the attention core (cache update and SDPA) runs per session, on that
  session's own cache objects at its own offset; caches are never padded to a
  common length (padding would change the reduction order);
- RoPE takes one offset per row;
- each random draw is taken per session from its own key, in the shape and
  order of the single call (:func:`~.mog_head.draw`).

The tests (``tests/test_batched_tts.py``) check the contract bit for bit.
On other backends a batched matmul may tile differently than a one-row one;
run the tests there before relying on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx

if TYPE_CHECKING:
    from .ear_tts import Cache, EarTTS, KeyStream

GUIDED_ROWS = 2  # [cond; uncond] rows per session


class KeyRows:
    """Per-session keys drawn in advance, ``[B, count, 2]``: each ``next`` hands
    out the next key of every session, ``[B, 2]`` (one key per batch row)."""

    def __init__(self, keys: mx.array):
        self.keys = keys
        self.index = 0

    def next(self) -> mx.array:
        keys = self.keys[:, self.index]
        self.index += 1
        return keys


def session_rows(hidden: mx.array, session: int, sessions: int) -> mx.array:
    """Session ``session``'s ``[cond; uncond]`` rows of a batched guided hidden."""
    return hidden[session::sessions]


def take_keys(rng: "KeyStream", count: int) -> mx.array:
    """The stream's next ``count`` keys, stacked, advancing it as ``generate_codes`` does."""
    take = getattr(rng, "take", None)
    return take(count) if take is not None else mx.stack([rng.next() for _ in range(count)])


def _check_batch(
    previous: mx.array, text: mx.array, caches: Sequence[Any], text_ids: Sequence[int]
) -> int:
    sessions = len(caches)
    if sessions == 0:
        raise ValueError("backbone_step_batch: caches is empty (need one per session)")
    if previous.ndim != 3 or previous.shape[:2] != (sessions, 1):
        raise ValueError(
            f"backbone_step_batch: previous must be [{sessions}, 1, Q], got {list(previous.shape)}"
        )
    if text.shape != (sessions, 1):
        raise ValueError(
            f"backbone_step_batch: text must be [{sessions}, 1], got {list(text.shape)}"
        )
    if len(text_ids) != sessions:
        raise ValueError(
            f"backbone_step_batch: text_ids has {len(text_ids)} ids for {sessions} sessions"
        )
    return sessions


def backbone_step_batch(
    tts: "EarTTS",
    previous: mx.array,
    text: mx.array,
    caches: Sequence["Cache"],
    text_ids: Sequence[int],
) -> mx.array:
    """:meth:`EarTTS.backbone_step` for ``B`` sessions: guided hidden ``[2B, 1, dims]``.

    ``previous`` [B, 1, Q], ``text`` [B, 1] (checked for shape; the host ids
    ``text_ids`` select the memoized embeddings, as the single call does when
    given ``token_id``), ``caches[b]`` session ``b``'s backbone caches.
    ``session_rows(out, b, B)`` equals ``backbone_step(previous[b:b+1],
    text[b:b+1], caches[b], text_ids[b])`` bit for bit, and ``caches[b]`` ends
    as that call leaves it.
    """
    sessions = _check_batch(previous, text, caches, text_ids)
    step = tts.gemma_step()
    if not all(step.ready(previous[b : b + 1], caches[b]) for b in range(sessions)):
        return _one_by_one(tts, previous, text, caches, text_ids)
    cond = mx.concatenate([tts.embed_subword.token(int(i)) for i in text_ids], axis=0)
    return step.batch(caches, GUIDED_ROWS, previous, tts._with_uncond(cond))


def _one_by_one(
    tts: "EarTTS",
    previous: mx.array,
    text: mx.array,
    caches: Sequence["Cache"],
    text_ids: Sequence[int],
) -> mx.array:
    """Fallback (a session off the compiled path, e.g. a mask is needed): single
    steps, laid out as the batch."""
    rows = [
        tts.backbone_step(previous[b : b + 1], text[b : b + 1], caches[b], int(text_ids[b]))
        for b in range(len(caches))
    ]
    stacked = mx.stack(rows, axis=1)  # [2, B, 1, dims]
    return stacked.reshape(-1, *stacked.shape[2:])


def generate_codes_batch(tts: "EarTTS", hidden: mx.array, rngs: Sequence["KeyStream"]) -> mx.array:
    """:meth:`EarTTS.generate_codes` for ``B`` sessions: guided hidden [2B, 1, dims]
    (the :func:`backbone_step_batch` layout) -> codes [B, 1, Q] int32.

    Row ``b`` equals ``generate_codes(session_rows(hidden, b, B), rngs[b])``
    bit for bit, and ``rngs[b]`` advances exactly as that call advances it
    (``2 * depth_passes`` keys, taken up front).
    """
    sessions = len(rngs)
    if sessions == 0 or hidden.shape[0] != GUIDED_ROWS * sessions:
        raise ValueError(
            f"generate_codes_batch: hidden has {hidden.shape[0]} rows, "
            f"expected {GUIDED_ROWS} per session for {sessions} key streams"
        )
    if sessions == 1:
        return tts.generate_codes(hidden, rngs[0])
    count = 2 * tts.depth_passes
    keys = mx.stack([take_keys(rng, count) for rng in rngs])
    return tts.compiled_depth_batch()(hidden, keys, *tts.codebook_arrays())
