"""Audio formats of the OpenAI Realtime GA dialect, converted on the fly.

GA clients send and expect ``audio/pcm`` (PCM16 little-endian mono at
24 kHz) or G.711 ``audio/pcmu`` / ``audio/pcma`` at 8 kHz. The model listens
at 16 kHz and its codec speaks at 22.05 kHz, so each direction goes through a
streaming resampler (``soxr.ResampleStream``: its filter state is kept from
one chunk to the next, so chunked output equals whole-signal output) and the
G.711 codec of ``audioop`` (the standard library's up to Python 3.12, the
maintained ``audioop-lts`` port from 3.13).
"""

from __future__ import annotations

import base64
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import soxr

from ...wire import decode_base64, pcm16_bytes, pcm16_samples

with warnings.catch_warnings():  # deprecated in the standard library of 3.11/3.12 only
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

PCM = "audio/pcm"
PCMU = "audio/pcmu"
PCMA = "audio/pcma"
RATES = {PCM: 24_000, PCMU: 8_000, PCMA: 8_000}
RESAMPLER_QUALITY = "HQ"


class FormatError(ValueError):
    """A client's audio format or audio payload is not usable."""


@dataclass(frozen=True)
class AudioFormat:
    type: str = PCM
    rate: int = RATES[PCM]

    def describe(self) -> dict[str, Any]:
        """The GA ``audio.*.format`` object (G.711 formats carry no rate)."""
        return {"type": self.type, "rate": self.rate} if self.type == PCM else {"type": self.type}


def parse_format(value: Any, where: str) -> AudioFormat:
    """A GA format object: ``{"type": "audio/pcm", "rate": 24000}`` or a G.711 type."""
    if not isinstance(value, dict):
        raise FormatError(f"{where} must be an object with a type")
    kind = value.get("type")
    if kind not in RATES:
        raise FormatError(f"{where}.type must be one of {', '.join(RATES)}, got {kind!r}"[:200])
    rate = value.get("rate", RATES[kind])
    if isinstance(rate, bool) or rate != RATES[kind]:
        raise FormatError(f"{where}.rate must be {RATES[kind]} for {kind}, got {rate!r}"[:200])
    return AudioFormat(kind, RATES[kind])


def decode(fmt: AudioFormat, data: bytes) -> np.ndarray:
    """Client bytes in ``fmt`` -> float32 samples in [-1, 1) at ``fmt.rate``."""
    if fmt.type == PCMU:
        data = audioop.ulaw2lin(data, 2)
    elif fmt.type == PCMA:
        data = audioop.alaw2lin(data, 2)
    try:
        return pcm16_samples(data, PCM)
    except ValueError as exc:
        raise FormatError(str(exc)) from None


def encode(fmt: AudioFormat, samples: np.ndarray) -> bytes:
    """Float samples at ``fmt.rate`` -> bytes in ``fmt``."""
    pcm = pcm16_bytes(samples)
    if fmt.type == PCMU:
        return audioop.lin2ulaw(pcm, 2)
    if fmt.type == PCMA:
        return audioop.lin2alaw(pcm, 2)
    return pcm


class Resampler:
    """A streaming resampler; the identity when the rates match."""

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream = None if in_rate == out_rate else soxr.ResampleStream(
            in_rate, out_rate, 1, dtype="float32", quality=RESAMPLER_QUALITY)

    def __call__(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples, last=last)


class InputAudio:
    """Client audio (``fmt``) -> its samples (:meth:`decode`) -> model samples at
    ``model_rate`` (:attr:`resample`)."""

    def __init__(self, fmt: AudioFormat, model_rate: int):
        self.format = fmt
        self.resample = Resampler(fmt.rate, model_rate)

    def decode(self, audio: Any) -> np.ndarray:
        """An append's base64 audio -> the client's samples, at its rate."""
        try:
            data = decode_base64(audio, "base64")
        except ValueError as exc:
            raise FormatError(str(exc)) from None
        return decode(self.format, data)


class MediaInput:
    """Audio from a media track (WebRTC: PCM16 at the track's 48 kHz) -> model samples,
    resampled once, straight to ``model_rate``, whatever the session's input format
    (OpenAI's WebRTC ignores it too). It counts as the samples of GA ``audio/pcm``
    (24 kHz) it lasts: what a resume reports as received."""

    def __init__(self, model_rate: int):
        self.model_rate = model_rate
        self.resample: Resampler | None = None  # the track's rate -> the model's
        self.taken = 0  # track samples since the rate was last set
        self.counted = 0  # those, counted at GA's rate

    def decode(self, data: bytes, rate: int) -> tuple[np.ndarray, int]:
        """The track's PCM16 at ``rate`` -> the model's samples, and how many samples of
        GA ``audio/pcm`` they count as."""
        if self.resample is None or self.resample.in_rate != rate:
            self.resample, self.taken, self.counted = Resampler(rate, self.model_rate), 0, 0
        try:
            samples = pcm16_samples(data, "media")
        except ValueError as exc:
            raise FormatError(str(exc)) from None
        self.taken += samples.shape[0]
        counted = self.taken * RATES[PCM] // rate - self.counted
        self.counted += counted
        return self.resample(samples), counted


class OutputAudio:
    """Model samples at ``model_rate`` -> audio bytes in ``fmt`` (base64 when called)."""

    def __init__(self, fmt: AudioFormat, model_rate: int):
        self.format = fmt
        self.resample = Resampler(model_rate, fmt.rate)

    def encoded(self, samples: np.ndarray, last: bool = False) -> bytes:
        """The next bytes of the client's audio (none while the resampler fills)."""
        return encode(self.format, self.resample(samples, last))

    def __call__(self, samples: np.ndarray, last: bool = False) -> str:
        return base64.b64encode(self.encoded(samples, last)).decode("ascii")
