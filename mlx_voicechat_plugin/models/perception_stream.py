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

import math
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.nemotron_asr.audio import PreprocessArgs, log_mel_spectrogram_frames

from ..config import ModelConfig
from .encoder_stream import EncoderStream
from .perception import Perception, log_mel


class MelStream:
    """Centred log-mel frames as audio arrives, from a bounded host-side sample tail.

    The frames are mlx-audio's ``log_mel_spectrogram_frames`` over the retained
    tail, as in its ``StreamingLogMelSpectrogram``; the tail lives in numpy so
    trimming it needs no evaluation. A frame is emitted once its centre trails
    the input edge by ``lookahead`` samples.
    """

    def __init__(self, args: PreprocessArgs, lookahead: int):
        if args.pad_to > 0 or args.normalize in ("per_feature", "all_features"):
            raise ValueError("streaming log-mel needs preprocessor pad_to=0 and normalize='NA'")
        if lookahead < args.n_fft // 2:
            raise ValueError(f"lookahead must be >= n_fft // 2 = {args.n_fft // 2}, got {lookahead}")
        self.args = args
        self.lookahead = lookahead
        # Samples before the next frame centre that the STFT and preemphasis read.
        self._lookbehind_frames = math.ceil((args.n_fft // 2 + 1) / args.hop_length)
        self._samples = np.zeros((0,), dtype=np.float32)
        self._start = 0  # stream index of ``_samples[0]``
        self._total = 0
        self._next_frame = 0

    def push(self, samples: np.ndarray) -> mx.array:
        """Mono float32 samples -> the ``(1, n, features)`` frames now complete (lazy)."""
        hop = self.args.hop_length
        self._samples = np.concatenate([self._samples, samples.astype(np.float32, copy=False)])
        self._total += samples.shape[0]
        centre = self._total - self.lookahead
        end = centre // hop + 1 if centre >= 0 else 0
        if end <= self._next_frame:
            return mx.zeros((1, 0, self.args.features), dtype=mx.float32)
        first = self._start // hop
        mel = log_mel_spectrogram_frames(
            mx.array(self._samples), self.args, self._next_frame - first, end - first
        )
        self._next_frame = end
        keep = max(end - self._lookbehind_frames, 0) * hop
        if keep > self._start:
            self._samples = self._samples[keep - self._start :]
            self._start = keep
        return mel


class PerceptionStream:
    def __init__(self, perception: Perception, config: ModelConfig, use_cache: bool = True):
        self.perception = perception
        self.config = config
        self.frame_samples = config.frame_samples
        self.use_cache = use_cache
        left, right = perception.att_context
        if use_cache:
            self._mel = MelStream(config.audio_config.preprocessor, self.frame_samples)
            self._encoder = EncoderStream(perception.encoder, left_context=left,
                                          positions=perception.window_positions())
        else:
            self._window_samples = max(2, left + right + 1) * self.frame_samples
            self._window = mx.zeros((0,), dtype=mx.float32)

    def push(self, frame: np.ndarray, clock: Any = None) -> tuple[mx.array, mx.array]:
        """``(frame_samples,)`` float32 audio -> lazy ``(projected, encoded)``, each ``(1, 1, D)``.

        Evaluate them together with :attr:`state` (the carried caches), or
        every frame's graph would hang off the previous one. ``clock`` (a
        profiling ``FrameClock``) times the sub-stages when given.
        """
        if self.use_cache:
            mel = self._mel.push(frame)
            if clock is not None:
                clock.sub_stage("perception.mel", mel)
            encoded = self._encoder.push(mel)
            if encoded.shape[1] != 1:
                raise RuntimeError(f"streaming encoder emitted {encoded.shape[1]} frames for one frame")
            projected = self.perception.proj(encoded)
            if clock is not None:
                clock.sub_stage("perception.layers", projected, encoded)
            return projected, encoded
        self._window = mx.concatenate([self._window, mx.array(frame)])[-self._window_samples :]
        mel = log_mel(self._window, self.config.audio_config)
        projected, _, encoded = self.perception(mel)
        if projected.shape[1] < 2:
            raise RuntimeError("perception returned fewer than two frames for one input frame")
        return projected[:, -2:-1], encoded[:, -2:-1]

    @staticmethod
    def push_batch(streams: list["PerceptionStream"], frames: list[np.ndarray],
                   clock: Any = None) -> list[tuple[mx.array, mx.array]]:
        """:meth:`push` of many streams of one perception, each result equal to its own.

        The mel frontends run per stream (host work); the encoder stack of
        streams with full windows and the projection take all rows at once.
        One stream (or any without the cache) runs its own :meth:`push`.
        """
        if not all(s.use_cache for s in streams) or len(streams) == 1:
            return [s.push(f, clock) for s, f in zip(streams, frames)]
        mels = [s._mel.push(f) for s, f in zip(streams, frames)]
        encoded = EncoderStream.push_batch([s._encoder for s in streams], mels)
        if any(e.shape[1] != 1 for e in encoded):
            raise RuntimeError("streaming encoder emitted other than one frame for one frame")
        projected = streams[0].perception.proj(mx.concatenate(encoded))
        return [(projected[b : b + 1], e) for b, e in enumerate(encoded)]

    @property
    def state(self) -> list[mx.array]:
        """The carried state to evaluate with each frame's outputs."""
        return self._encoder.state if self.use_cache else [self._window]

    def step(self, frame: np.ndarray, clock: Any = None) -> tuple[mx.array, mx.array]:
        """:meth:`push` with its own evaluation: evaluated ``(projected, encoded)``."""
        projected, encoded = self.push(frame, clock)
        mx.eval(projected, encoded, *self.state)
        return projected, encoded
