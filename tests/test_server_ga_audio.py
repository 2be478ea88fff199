"""The GA dialect's audio formats: streaming resampling and G.711, chunk by chunk."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import soxr

from mlx_voicechat_plugin.server.dialects.ga.audio import (
    PCM,
    PCMA,
    PCMU,
    AudioFormat,
    FormatError,
    InputAudio,
    OutputAudio,
    Resampler,
    decode,
    encode,
    parse_format,
)
from mlx_voicechat_plugin.testing.fixtures import question_signal

# Chunked streaming output equals the one-call streaming output of the same
# signal to within this bound (soxr keeps its filter state across chunks; in
# practice the two are bit-identical).
CHUNK_BOUND = 1e-6
CONVERSIONS = [(24_000, 16_000), (22_050, 24_000), (8_000, 16_000), (22_050, 8_000)]
CHUNK_MS = [1, 7, 20, 80, 333, 1000]


def _signal(rate: int, seconds: float = 2.0) -> np.ndarray:
    return soxr.resample(question_signal(seconds), 16_000, rate).astype(np.float32)


def _chunked(resampler: Resampler, samples: np.ndarray, size: int) -> np.ndarray:
    parts = [resampler(samples[i : i + size]) for i in range(0, samples.shape[0], size)]
    parts.append(resampler(np.zeros(0, np.float32), last=True))
    return np.concatenate(parts)


@pytest.mark.parametrize("rates", CONVERSIONS, ids=lambda r: f"{r[0]}to{r[1]}")
@pytest.mark.parametrize("ms", CHUNK_MS)
def test_chunked_resampling_equals_whole_signal_resampling(rates, ms):
    source, target = rates
    samples = _signal(source)
    whole = Resampler(source, target)(samples, last=True)
    chunked = _chunked(Resampler(source, target), samples, max(1, source * ms // 1000))
    assert chunked.shape == whole.shape
    assert np.abs(chunked - whole).max() <= CHUNK_BOUND


@pytest.mark.parametrize("rates", CONVERSIONS, ids=lambda r: f"{r[0]}to{r[1]}")
def test_resampling_keeps_the_duration_and_the_signal(rates):
    source, target = rates
    samples = _signal(source)
    out = Resampler(source, target)(samples, last=True)
    assert out.shape[0] == round(samples.shape[0] * target / source)
    back = soxr.resample(out, target, source)[: samples.shape[0]]
    band = 3400 if min(rates) == 8_000 else 7000  # what the lower rate can carry
    expected = soxr.resample(soxr.resample(samples, source, 2 * band), 2 * band, source)
    assert np.sqrt(np.mean((back - expected[: back.shape[0]]) ** 2)) < 0.02


def test_equal_rates_pass_samples_through():
    samples = _signal(16_000, 0.1)
    assert np.array_equal(Resampler(16_000, 16_000)(samples), samples)


@pytest.mark.parametrize("kind", [PCMU, PCMA])
def test_g711_round_trip_is_within_its_quantization(kind):
    fmt = AudioFormat(kind, 8_000)
    samples = _signal(8_000, 0.5)
    data = encode(fmt, samples)
    assert len(data) == samples.shape[0]  # one byte a sample
    back = decode(fmt, data)
    # G.711 is logarithmic: the error is a few percent of the sample, plus a floor.
    assert np.all(np.abs(back - samples) <= 0.07 * np.abs(samples) + 2e-3)


def test_g711_encodes_as_the_standard_codec_does():
    fmt = AudioFormat(PCMU, 8_000)
    # u-law of digital silence is 0xFF, of full scale 0x80 (ITU-T G.711)
    assert encode(fmt, np.zeros(4, np.float32)) == b"\xff" * 4
    assert encode(fmt, np.ones(1, np.float32))[0] in (0x80, 0x81)
    assert encode(AudioFormat(PCMA, 8_000), np.zeros(2, np.float32)) == b"\xd5" * 2


def test_pcm_input_reaches_the_model_at_16_khz():
    samples = _signal(24_000, 1.0)
    pcm = np.round(samples * 32767).astype("<i2").tobytes()
    convert = InputAudio(AudioFormat(PCM, 24_000), 16_000)
    step = 480  # 10 ms chunks of 240 samples
    chunks = [base64.b64encode(pcm[i : i + step]).decode() for i in range(0, len(pcm), step)]
    out = np.concatenate([convert.resample(convert.decode(chunk)) for chunk in chunks])
    # a streaming resampler holds back its filter's delay (~21 ms here) until the end
    assert 16_000 - 400 <= out.shape[0] <= 16_000


def test_output_audio_is_base64_pcm16_at_24_khz():
    convert = OutputAudio(AudioFormat(PCM, 24_000), 22_050)
    frames = [convert(np.zeros(1764, np.float32)) for _ in range(10)]
    frames.append(convert(np.zeros(0, np.float32), last=True))
    total = sum(len(base64.b64decode(f)) for f in frames) // 2
    assert total == round(10 * 1764 * 24_000 / 22_050)


@pytest.mark.parametrize("value, message", [
    ({"type": "audio/opus"}, "type must be one of"),
    ({"type": "audio/pcm", "rate": 16000}, "rate must be 24000"),
    ({"type": "audio/pcmu", "rate": 16000}, "rate must be 8000"),
    ("pcm16", "must be an object"),
])
def test_bad_formats_name_the_field(value, message):
    with pytest.raises(FormatError, match=message) as failure:
        parse_format(value, "session.audio.input.format")
    assert "session.audio.input.format" in str(failure.value)


def test_g711_formats_describe_themselves_without_a_rate():
    assert parse_format({"type": "audio/pcma"}, "f").describe() == {"type": "audio/pcma"}
    assert parse_format({"type": "audio/pcm"}, "f").describe() == {"type": "audio/pcm",
                                                                   "rate": 24000}


def test_odd_pcm_bytes_are_refused():
    with pytest.raises(FormatError, match="even number of bytes"):
        decode(AudioFormat(), b"\x00\x01\x02")
