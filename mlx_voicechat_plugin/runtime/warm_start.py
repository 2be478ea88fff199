"""What every conversation's EAR-TTS starts from: the speaker-prompt warm-up.

A pure function of the weights, so the runtime computes it once (or reads back the
one remembered for its checkpoint, :mod:`~..models.remembered`) and copies it into
each conversation's timeline (:mod:`.timeline`).
"""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..models.cache_state import (
    MetaState,
    cache_meta_state,
    cache_state,
    caches_from_state,
    copy_arrays,
)
from ..models.language.context import ContextWindow, bound_all
from ..models.model import Model
from ..models.remembered import WARM_START_DIR, checkpoint_key, load_arrays, save_arrays
from ..models.speech.ear_tts import sliding_windows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStart:
    """What every conversation's EAR-TTS starts from: its backbone caches after the
    speaker-prompt warm-up (``state`` and ``meta_state``) and the codes of its last
    frame. A pure function of the weights, computed once (:meth:`of`) by the
    runtime that makes conversations and copied into each."""

    state: list[mx.array]
    meta_state: MetaState
    prev_codes: mx.array  # (1, 1, Q)
    sliding: tuple[int | None, ...] = ()  # each backbone layer's own window (None: global)

    @classmethod
    def of(cls, model: Model) -> "WarmStart":
        """Run the warm-up (evaluated), or read back the one remembered for the
        checkpoint the model's weights are (:mod:`~..models.remembered`)."""
        # Keyed on the checkpoint alone: float32 copies or not, the warm start is the same
        # bits (a bf16 weight is upcast exactly to the float32 activations it multiplies).
        key = checkpoint_key(getattr(model, "checkpoint_path", None), "warm-start")
        remembered = load_arrays(WARM_START_DIR, key)
        if remembered is not None:
            try:
                return cls._remembered(*remembered)
            except (KeyError, ValueError, ImportError, AttributeError) as error:
                logger.warning("ignoring the remembered warm start: %s", error)
        start = cls._run(model)
        meta = [[kind.__module__, kind.__qualname__, m, list(present)]
                for kind, m, present in start.meta_state]
        save_arrays(WARM_START_DIR, key, [*start.state, start.prev_codes],
                    {"meta_state": json.dumps(meta), "sliding": json.dumps(list(start.sliding))})
        return start

    @classmethod
    def _remembered(cls, arrays: list[mx.array], metadata: dict[str, str]) -> "WarmStart":
        meta_state = tuple(
            (getattr(importlib.import_module(module), name),
             tuple(m) if isinstance(m, list) else m, tuple(present))
            for module, name, m, present in json.loads(metadata["meta_state"]))
        mx.eval(arrays)
        return cls(arrays[:-1], meta_state, arrays[-1],
                   tuple(json.loads(metadata["sliding"])))

    @classmethod
    def _run(cls, model: Model) -> "WarmStart":
        speech = model.tts_model
        codes, ids, id_mask, audio_mask, latents = speech.warmup_inputs(model.config.pad_token_id)
        hidden, cache = speech.tts_model.warmup(codes, ids, id_mask, audio_mask, latents)
        start = cls(cache_state(cache), cache_meta_state(cache), codes[:, -1:],
                    tuple(sliding_windows(speech.tts_model.config)))
        mx.eval(hidden, start.prev_codes, start.state)
        return start

    def fresh_cache(self, context: ContextWindow | None = None) -> list[Any]:
        """One conversation's backbone caches: new objects over new array handles of
        the same values, so conversations never see each other's writes (``context``:
        continued as rings of that bounded context, :mod:`~..models.context`)."""
        caches = caches_from_state(copy_arrays(self.state), self.meta_state)
        if context is None:
            return caches
        return bound_all(caches, context, self.sliding)

    @property
    def positions(self) -> int:
        """Backbone positions the warm-up wrote."""
        return max(c.offset for c in caches_from_state(self.state, self.meta_state))
