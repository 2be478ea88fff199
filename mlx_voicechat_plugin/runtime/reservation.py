"""What one session's state may reach: its bounded context, and the bytes it reserves at open.

A conversation's state is constant apart from its attention KV caches (the
Nemotron-H attention layers and every EAR-TTS backbone layer). With a
bounded context (``context_seconds``, :mod:`~..models.context`) those are
rings of ``prompt + window`` positions; without one they grow by one
position a frame up to the session's ``max_streaming_seconds``. So a
session's worst case is known when it opens, from the config:

- the KV part (:func:`kv_bytes`): per position, ``2 (K, V) x kv_heads x
  head_dim x 4 bytes`` (the caches hold float32: the fused inputs are
  float32) per LLM attention layer, and the same times two rows (the
  ``[cond; uncond]`` guidance batch) per backbone layer; positions per layer
  are the ring's size (or the sliding window when smaller), or the prompt
  plus every frame the session may run;
- the fixed part (Mamba2 states, the encoder's 70-frame windows, the RNNT
  carry, the codec stream, previous tokens and keys): measured once per
  model on a short probe stream and grown to the encoder's full window
  (:meth:`Reservations.fixed_bytes`), plus the PCM a session may buffer.

:class:`~.pool.StreamPool` reserves :meth:`Reservations.of` of a
session before its prefill and admits it only if the reservations of the
open sessions and its own fit ``--max-state-bytes``, so growth never takes
the measured state past the budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..models.language.context import ContextWindow, window_capacity
from ..models.speech.ear_tts import GUIDED_ROWS, sliding_windows
from .options import ConversationOptions

logger = logging.getLogger(__name__)

KV_ITEMSIZE = 4  # float32 keys and values (the caches keep the fused inputs' dtype)
# Frames a session's fixed state is measured over before it grows one encoder window
# row a frame (:meth:`Reservations.fixed_bytes`).
PROBE_FRAMES = 4



def context_frames(context_seconds: float | None, frame_duration: float) -> int | None:
    """Frames of a bounded context (at least one), ``None`` when unbounded."""
    if not context_seconds:
        return None
    return max(1, round(context_seconds / frame_duration))


@dataclass(frozen=True)
class ConversationShape:
    """What fixes a conversation's attention caches: its prompt's LLM positions, the
    backbone positions of the warm start, and the bounded context's frames (or ``None``)."""

    prompt: int
    warm: int
    recent: int | None

    def windows(self) -> tuple[ContextWindow, ContextWindow] | None:
        """The LLM's and the backbone's contexts: the LLM keeps the prompt's positions,
        the backbone the warm start and the prompt's frames after the first (the first
        position has no TTS step)."""
        if self.recent is None:
            return None
        return (ContextWindow(self.prompt, self.recent),
                ContextWindow(self.warm + max(self.prompt - 1, 0), self.recent))

    def positions(self, frames: int) -> tuple[int, int]:
        """LLM and backbone positions written after ``frames`` conversation frames."""
        return self.prompt + frames, self.warm + max(self.prompt + frames - 1, 0)


def _head_dim(c: Any) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def kv_bytes(config: Any, shape: ConversationShape, frames: int | None) -> int:
    """Bytes the attention caches hold after ``frames`` frames (``None``: ever, which
    needs a bounded context)."""
    if frames is None and shape.recent is None:
        raise ValueError("an unbounded context has no worst case without a frame limit")
    llm_window, tts_window = shape.windows() or (None, None)
    # Positions written: after ``frames`` frames, or ever (each ring holds its size at most).
    llm_at, tts_at = (shape.positions(frames) if frames is not None
                      else (llm_window.size, tts_window.size))
    # KV bytes of one position: per LLM attention layer, and per backbone layer.
    text, tts = config.text_config, config.tts_config
    llm_per = 2 * text.num_key_value_heads * _head_dim(text) * KV_ITEMSIZE
    tts_per = 2 * tts.num_key_value_heads * _head_dim(tts) * KV_ITEMSIZE * GUIDED_ROWS
    layers = str(config.text_config.hybrid_override_pattern).count("*")  # attention ones
    llm = layers * window_capacity(llm_window, None, llm_at) * llm_per
    tts = sum(window_capacity(tts_window, s, tts_at)
              for s in sliding_windows(config.tts_config)) * tts_per
    return llm + tts


def minute_bytes(config: Any, minute: int = 1, warm: int = 0, prompt: int = 0) -> int:
    """What minute ``minute`` (1: the first) of an unbounded conversation adds to its
    caches: every layer's position while the layer grows (the release's sliding layers
    for their first 7500 frames, 10 minutes; its global layers always)."""
    shape = ConversationShape(prompt, warm, None)
    frames = round(60 / config.frame_duration)
    return kv_bytes(config, shape, minute * frames) - kv_bytes(config, shape, (minute - 1) * frames)


def fixed_state_sizes(voicechat: Any, frames: int) -> list[int]:
    """A probe stream's non-KV state bytes (no prompt, unbounded context) after each of
    its first ``frames`` frames of silence."""
    config = voicechat.config
    stream = voicechat.create_streaming_session(options=ConversationOptions(context_seconds=0))
    silence = np.zeros((config.frame_samples,), np.float32)
    sizes = []
    try:
        shape = ConversationShape(0, voicechat.warm_start.positions, None)
        for frame in range(frames):
            stream.push_audio(silence)
            sizes.append(stream.core.compute.nbytes - kv_bytes(config, shape, frame + 1))
    finally:
        stream.cancel()
    return sizes


class Reservations:
    """The fixed part of one model's sessions, measured once per ``VoiceChat`` (kept
    there, in its ``fixed_state_bytes``: :meth:`fixed_bytes`)."""

    def __init__(self, voicechat: Any):
        self.voicechat = voicechat

    def fixed_bytes(self) -> int:
        """The largest non-KV state of a conversation: measured on a probe stream (no
        prompt, unbounded) over its first :data:`PROBE_FRAMES` frames, then grown at the
        last frame's rate until the encoder's window is full (``left_context`` frames,
        where the full probe, :func:`fixed_state_sizes`, stops growing: one window row
        per layer a frame; ``tests/test_memory_budget.py`` checks both agree). A few
        frames instead of the window's 72: a full-size start on a CPU took minutes."""
        vc = self.voicechat
        if vc.fixed_state_bytes is None:
            window = vc.model.stt_model.perception.att_context[0]
            sizes = fixed_state_sizes(vc, min(PROBE_FRAMES, window + 2))
            rate = sizes[-1] - sizes[-2]
            fixed = max(max(sizes), sizes[-1] + rate * max(window - len(sizes), 0))
            vc.fixed_state_bytes = fixed
            logger.info("session state: %d fixed bytes, measured over %d frames and grown "
                        "to the encoder's %d-frame window", fixed, len(sizes), window)
        return vc.fixed_state_bytes

    def of(self, options: Any, prompt: int) -> int:
        """The worst-case state bytes of a session with these options and ``prompt`` LLM
        positions: the fixed part, the KV caches at their largest (a full ring, or every
        frame of ``max_streaming_seconds``), and its PCM buffer."""
        config = self.voicechat.config
        shape = ConversationShape(prompt, self.voicechat.warm_start.positions,
                                  context_frames(options.context_seconds, config.frame_duration))
        frames = None
        if shape.recent is None:
            if options.max_streaming_seconds is None:
                raise ValueError("a session without a bounded context (context_seconds) needs "
                                 "max_streaming_seconds to be reserved")
            frames = options.max_frames(config.frame_duration)
        # PCM waiting for a frame: less than a frame once a push is split into frames.
        pending = options.max_buffered_samples or config.frame_samples
        return (self.fixed_bytes() + kv_bytes(config, shape, frames)
                + pending * np.dtype(np.float32).itemsize)
