"""Perception: log-mel frontend, cache-aware FastConformer and the LLM projection.

The mel frontend (preemphasis 0.97, 25/10 ms symmetric Hann padded to n_fft
512 with reflect padding, 128 Slaney bins, ``ln(x + 2**-24)``) and the
FastConformer blocks are mlx-audio's generic nemotron_asr pieces; this module
binds them to the VoiceChat checkpoint layout (``stt_model.perception.*``).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram
from mlx_audio.stt.models.nemotron_asr.conformer import Conformer

from ...config import AudioConfig
from .encoder_stream import WindowPositions
from ..remembered import WINDOW_POSITIONS_DIR, checkpoint_key, load_arrays, save_arrays


def log_mel(waveform: mx.array, config: AudioConfig) -> mx.array:
    """``(samples,)`` float32 at 16 kHz -> ``(1, frames, features)`` log-mel."""
    if waveform.ndim != 1:
        raise ValueError(f"waveform must be 1-D mono, got shape {waveform.shape}")
    return log_mel_spectrogram(waveform.astype(mx.float32), config.preprocessor)


class Perception(nn.Module):
    """FastConformer encoder (70-frame left context) and projection to the LLM."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        self.encoder = Conformer(config.encoder)
        self.proj = nn.Linear(config.encoder.d_model, config.output_dim, bias=True)
        self._window_positions: WindowPositions | None = None

    def window_positions(self, checkpoint: Path | None = None) -> WindowPositions:
        """The streaming encoder's positional projections, computed on first use, or read
        back where they were remembered for ``checkpoint`` (the path these weights were
        loaded from, :mod:`.remembered`; 1.2 s of a full-size session's start on a CPU)."""
        if self._window_positions is None:
            window = self.att_context[0] + 1
            layers = self.encoder.layers
            key = checkpoint_key(checkpoint, "window-positions", f"window {window}",
                                 str(layers[0].self_attn.linear_pos.weight.dtype))
            remembered = load_arrays(WINDOW_POSITIONS_DIR, key)
            full = remembered[0] if remembered and len(remembered[0]) == len(layers) else None
            self._window_positions = WindowPositions(self.encoder, window, mx.float32, full)
            if full is None:
                save_arrays(WINDOW_POSITIONS_DIR, key, self._window_positions.full, {})
        return self._window_positions

    def forget_derived(self) -> None:
        """Drop what was computed from the weights (they are being replaced)."""
        self._window_positions = None

    def update(self, parameters: dict, strict: bool = True) -> "Perception":
        self.forget_derived()
        return super().update(parameters, strict=strict)

    @property
    def att_context(self) -> list[int]:
        return list(self.config.encoder.att_context_size[0])

    def __call__(
        self, mel: mx.array, lengths: mx.array | None = None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Return ``(projected, lengths, encoded)`` for ``(B, T, F)`` mel."""
        encoded, lengths = self.encoder(mel, lengths=lengths, att_context_size=self.att_context)
        return self.proj(encoded), lengths, encoded

    def encode_signal(self, waveform: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Whole-signal perception: ``(samples,)`` 16 kHz audio -> lazy ``(projected,
        lengths, encoded)``, the encoder over the signal's log-mel at once (offline
        turns, file transcription, the streaming diagnostics window)."""
        return self(log_mel(waveform, self.config))
