"""Perception one 80 ms frame at a time, from persistent state.

With the cache (default): a streaming log-mel frontend keeps only the sample
tail its centred STFT still needs and emits a mel frame once it trails the
input edge by one frame (1280 samples); the cache-aware FastConformer
(:mod:`.encoder_stream`) keeps per layer the last 70 attention inputs and the
last ``kernel - 1`` conv inputs, plus a 16-frame mel cache for the causal
subsampling stack. Work and memory per frame are bounded.

Without the cache (diagnostics): the encoder reruns over the last
``left + right + 1`` frames of audio and takes the second-to-last output (the
last one sees the frontend's right-edge padding).

A :class:`PerceptionStream` is one stream's state: its host-side mel tail
(:class:`~.mel_stream.MelStream`, numpy, trimmed without an evaluation) and
its :class:`EncoderCache`. A frame of many streams (:func:`push_frames`, one
stream being ``B = 1``) frames each stream's samples on the host and runs the
device half of the log-mel once for the streams whose frames have equal
shapes (:func:`~.mel_stream.log_mel_many`), subsamples windows of equal shape
as one batch, merges the encoder caches of equal shapes into one batch, runs
it, and writes each row's cache back into its stream.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..config import ModelConfig
from .encoder_cache import EncoderCache
from .encoder_stream import EncoderStream
from .mel_stream import MelStream, log_mel_many
from .perception import Perception
from .rows import stack_rows, take_row


class PerceptionStream:
    """One stream's perception state; :func:`push_frames` advances streams by a frame.

    ``encoder`` is the model's :class:`EncoderStream` (one per loaded model, so
    its graphs compile once; ``VoiceChat`` passes its own); without it the
    stream makes its own.
    """

    def __init__(self, perception: Perception, config: ModelConfig, use_cache: bool = True,
                 encoder: EncoderStream | None = None):
        self.perception = perception
        self.config = config
        self.frame_samples = config.frame_samples
        self.use_cache = use_cache
        left, right = perception.att_context
        if use_cache:
            self.mel = MelStream(config.audio_config.preprocessor, self.frame_samples)
            self.encoder = encoder or EncoderStream(
                perception.encoder, left_context=left, positions=perception.window_positions())
            self.cache: EncoderCache = self.encoder.make_cache()
        else:
            self._window_samples = max(2, left + right + 1) * self.frame_samples
            self.window = mx.zeros((0,), dtype=mx.float32)

    @property
    def state(self) -> list[mx.array]:
        """The carried arrays, to evaluate with each frame's outputs (the mel tail is host data)."""
        return self.cache.state if self.use_cache else [self.window]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        if self.use_cache:
            self.cache.state = arrays
        else:
            (self.window,) = arrays

    @property
    def nbytes(self) -> int:
        """The bytes of ``state`` (sized without taking a batch's rows apart)."""
        return self.cache.nbytes if self.use_cache else self.window.nbytes

    @staticmethod
    def carried(streams: list["PerceptionStream"]) -> list[mx.array]:
        """The arrays the streams carry, each once: ``state`` of each, with the windows a
        batch's rows share once for all of them (:meth:`~.encoder_cache.EncoderCache.carried`)."""
        if all(s.use_cache for s in streams):
            return EncoderCache.carried([s.cache for s in streams])
        return [a for s in streams for a in s.state]

    def rerun(self, frame: np.ndarray) -> tuple[mx.array, mx.array]:
        """Without the cache: the whole-signal perception of the last window (diagnostics)."""
        self.window = mx.concatenate([self.window, mx.array(frame)])[-self._window_samples :]
        projected, _, encoded = self.perception.encode_signal(self.window)
        if projected.shape[1] < 2:
            raise RuntimeError("perception returned fewer than two frames for one input frame")
        return projected[:, -2:-1], encoded[:, -2:-1]


def push_frames(streams: list[PerceptionStream], frames: list[np.ndarray],
                clock: Any = None) -> tuple[mx.array, mx.array]:
    """One ``(frame_samples,)`` frame of each stream of one perception -> lazy
    ``(projected, encoded)``, each ``(B, 1, D)``, row ``b`` stream ``b``'s own.

    The mel frontends frame per stream (host work) and run their device half
    once per shape of frames; the encoder stack takes the streams with equal
    cache shapes as one batch (:meth:`EncoderStream.push`)
    and the projection takes every row at once. Evaluate the results with
    each stream's :attr:`~PerceptionStream.state` (the carried caches), or
    every frame's graph would hang off the previous one. ``clock`` (a
    profiling ``FrameClock``) times the sub-stages when given.
    """
    cached = [b for b, s in enumerate(streams) if s.use_cache]
    encoded = projected = None
    if cached:
        mels = log_mel_many([streams[b].mel for b in cached], [frames[b] for b in cached])
        if clock is not None:
            clock.sub_stage("perception.mel", *mels)
        lead = streams[cached[0]]
        encoded, caches = lead.encoder.push([streams[b].cache for b in cached], mels)
        if encoded.shape[1] != 1:
            raise RuntimeError(f"streaming encoder emitted {encoded.shape[1]} frames for one frame")
        for b, cache in zip(cached, caches):
            streams[b].cache = cache
        projected = lead.perception.proj(encoded)
        if clock is not None:
            clock.sub_stage("perception.layers", projected, encoded)
        if len(cached) == len(streams):
            return projected, encoded
    # Streams without the cache (diagnostics) rerun their windows, row by row.
    rows = [None if s.use_cache else s.rerun(f) for s, f in zip(streams, frames)]
    for j, b in enumerate(cached):
        rows[b] = (take_row(projected, j), take_row(encoded, j))
    return stack_rows([p for p, _ in rows]), stack_rows([e for _, e in rows])
