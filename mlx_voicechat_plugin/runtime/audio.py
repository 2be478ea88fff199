"""Reading and preparing input audio for the 16 kHz timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Union

import mlx.core as mx
import numpy as np

AudioInput = Union[str, Path, mx.array, np.ndarray]


def as_mono_float32(samples: np.ndarray, what: str) -> np.ndarray:
    """``samples`` as 1-D finite float32; ``(1, n)``/``(n, 1)`` are accepted as mono."""
    if samples.ndim == 2 and 1 in samples.shape:
        samples = samples.reshape(-1)
    if samples.ndim != 1:
        raise ValueError(f"{what} must be mono (1-D), got shape {samples.shape}")
    if not np.isfinite(samples).all():
        raise ValueError(f"{what} contains non-finite samples")
    return samples.astype(np.float32, copy=False)


def as_pcm_chunk(samples: object) -> np.ndarray:
    """One streamed PCM chunk, validated: a numpy or mlx array of finite float samples."""
    if isinstance(samples, mx.array):
        samples = np.array(samples)
    if not isinstance(samples, np.ndarray):
        raise TypeError(f"audio chunk must be a numpy or mlx array, got {type(samples).__name__}")
    if not np.issubdtype(samples.dtype, np.floating):
        raise TypeError(f"audio chunk must hold float samples in [-1, 1], got dtype {samples.dtype}")
    return as_mono_float32(samples, "audio chunk")


def read_samples(audio: AudioInput, sample_rate: int, input_rate: int | None = None) -> np.ndarray:
    """Mono float32 at ``sample_rate``, on the host (no device allocation).

    Paths go through the host's audio reader (WAV/FLAC/MP3, resampled and
    downmixed on read); arrays are taken to be at ``input_rate`` (default:
    ``sample_rate``) and resampled if it differs.
    """
    if isinstance(audio, (str, Path)):
        path = Path(audio)
        if not path.is_file():
            raise FileNotFoundError(f"audio file not found: {path}")
        from mlx_audio.audio_io import read

        samples, _ = read(str(path), dtype="float32", sample_rate=sample_rate, nchannels=1)
        return np.asarray(samples, dtype=np.float32).reshape(-1)
    array = as_mono_float32(np.asarray(audio, dtype=np.float32), "audio")
    if input_rate not in (None, sample_rate):
        from mlx_audio.utils import resample_audio

        array = np.asarray(resample_audio(array, input_rate, sample_rate), dtype=np.float32)
    return array


def load_waveform(audio: AudioInput, sample_rate: int, input_rate: int | None = None) -> mx.array:
    """:func:`read_samples` as a device array."""
    return mx.array(read_samples(audio, sample_rate, input_rate))


def to_pcm16(samples: np.ndarray | mx.array, scale: float = 32767.0) -> np.ndarray:
    """``round(clip(x, -1, 1) * scale)`` in the int16 range, little-endian."""
    data = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return np.clip(np.round(data * scale), -32768, 32767).astype("<i2")


def write_wav(
    path: str | Path, samples: np.ndarray | mx.array, sample_rate: int, scale: float = 32767.0
) -> None:
    """Mono PCM16 WAV of float samples in [-1, 1]."""
    import wave

    pcm = to_pcm16(samples, scale)
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(sample_rate)
        handle.writeframes(pcm.tobytes())
