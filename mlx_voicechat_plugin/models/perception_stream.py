"""Perception one 80 ms frame at a time, from persistent state.

With the cache (default): a streaming log-mel frontend keeps only the sample
tail its centred STFT still needs and emits a mel frame once it trails the
input edge by one frame (1280 samples); the cache-aware FastConformer keeps
per layer the last 70 attention inputs and the last ``kernel - 1`` conv inputs,
plus a 16-frame mel cache for the causal subsampling stack. Work and memory
per frame are bounded.

Without the cache (diagnostics): the encoder reruns over the last
``left + right + 1`` frames of audio and takes the second-to-last output (the
last one sees the frontend's right-edge padding).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_audio.stt.models.nemotron_asr import StreamingLogMelSpectrogram

from ..config import ModelConfig
from .encoder_stream import EncoderStream
from .perception import Perception, log_mel


class PerceptionStream:
    def __init__(self, perception: Perception, config: ModelConfig, use_cache: bool = True):
        self.perception = perception
        self.config = config
        self.frame_samples = config.frame_samples
        self.use_cache = use_cache
        left, right = perception.att_context
        if use_cache:
            self._mel = StreamingLogMelSpectrogram(
                config.audio_config.preprocessor, lookahead_samples=self.frame_samples
            )
            self._encoder = EncoderStream(perception.encoder, left_context=left)
        else:
            self._window_samples = max(2, left + right + 1) * self.frame_samples
            self._window = mx.zeros((0,), dtype=mx.float32)

    def step(self, frame: mx.array, clock: Any = None) -> tuple[mx.array, mx.array]:
        """``(frame_samples,)`` audio -> ``(projected, encoded)``, each ``(1, 1, D)``.

        Returns evaluated arrays (the carried caches are evaluated with them).
        ``clock`` (a profiling ``FrameClock``) times the sub-stages when given.
        """
        if self.use_cache:
            mel = self._mel.push(frame)
            if clock is not None:
                clock.sub_stage("perception.mel", mel)
            encoded = self._encoder.push(mel)
            if encoded.shape[1] != 1:
                raise RuntimeError(f"streaming encoder emitted {encoded.shape[1]} frames for one frame")
            projected = self.perception.proj(encoded)
            mx.eval(projected, encoded, *self._encoder.state())
            if clock is not None:
                clock.sub_stage("perception.layers")
            return projected, encoded
        self._window = mx.concatenate([self._window, frame])[-self._window_samples :]
        mel = log_mel(self._window, self.config.audio_config)
        projected, _, encoded = self.perception(mel)
        if projected.shape[1] < 2:
            raise RuntimeError("perception returned fewer than two frames for one input frame")
        projected, encoded = projected[:, -2:-1], encoded[:, -2:-1]
        mx.eval(projected, encoded, self._window)
        return projected, encoded
