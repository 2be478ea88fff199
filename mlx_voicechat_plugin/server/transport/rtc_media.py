"""A WebRTC call's audio: the client's track read as PCM16, the model's speech as a paced track.

The client's Opus track is decoded by aiortc (48 kHz); :func:`read_track`
hands each decoded frame over as one :class:`~..messages.AudioIn` (PCM16
mono at the frame's rate). :class:`SpeechTrack` is the track the client
hears: the model's audio (:class:`~..messages.AudioOut` bytes, PCM16 or
G.711 at their rate) resampled to 48 kHz (``soxr``, a stream per input
rate, so chunked output equals whole-signal output) and sent in 20 ms frames
paced in real time; silence while there is none (a call's audio never
pauses), which aiortc's sender encodes as Opus. Marks
(:class:`~..messages.AudioMark`) queued between the chunks are handed to
``on_mark`` as playback reaches them; :meth:`SpeechTrack.clear` drops the
queued speech and marks (a barge-in). Needs ``aiortc`` (the
``webrtc`` extra).
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
import warnings
from collections import deque
from typing import Any, Callable

import av
import numpy as np
import soxr
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from ..messages import AudioIn, AudioMark, ClientNotReading
from ..wire import pcm16_samples

with warnings.catch_warnings():  # deprecated in the standard library of 3.11/3.12 only
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

logger = logging.getLogger(__name__)

RATE = 48_000  # WebRTC's Opus clock
FRAME_SAMPLES = 960  # 20 ms, the frame a browser sends and expects
TIME_BASE = fractions.Fraction(1, RATE)
G711 = {"audio/pcmu": audioop.ulaw2lin, "audio/pcma": audioop.alaw2lin}
MAX_SPEECH_SECONDS = 60.0  # the model's audio waiting unplayed before the call counts as stuck


def mono_pcm16(frame: Any) -> bytes:
    """A decoded ``av.AudioFrame`` -> its first channel as PCM16 little-endian bytes."""
    if frame.format.name not in ("s16", "s16p"):
        frame = av.AudioResampler(format="s16", layout=frame.layout.name,
                                  rate=frame.sample_rate).resample(frame)[0]
    data = frame.to_ndarray()
    channels = len(frame.layout.channels)
    mono = data[0] if frame.format.is_planar else data.reshape(-1, channels)[:, 0]
    return np.ascontiguousarray(mono, dtype="<i2").tobytes()


async def read_track(track: Any, deliver: Callable[[AudioIn], None]) -> None:
    """Each frame of the client's ``track`` as an :class:`AudioIn`, until the track ends."""
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        deliver(AudioIn(mono_pcm16(frame), frame.sample_rate))


def speech_samples(data: bytes, encoding: str) -> np.ndarray:
    """An :class:`AudioOut`'s bytes (PCM16, or a G.711 type) -> float samples."""
    if encoding in G711:
        data = G711[encoding](data, 2)
    return pcm16_samples(data, "speech")


class SpeechTrack(MediaStreamTrack):
    """The model's speech at 48 kHz in 20 ms frames, one every 20 ms; silence between."""

    kind = "audio"

    def __init__(self, max_seconds: float = MAX_SPEECH_SECONDS,
                 on_mark: Callable[[AudioMark], None] | None = None):
        super().__init__()
        self.max_samples = int(max_seconds * RATE)
        self.on_mark = on_mark
        # int16 at 48 kHz not yet sent, and the marks between them
        self.chunks: deque[np.ndarray | AudioMark] = deque()
        self.queued = 0  # samples in ``chunks``
        self.resamplers: dict[int, Any] = {}  # input rate -> its soxr stream
        self.started: float | None = None  # when the first frame went out
        self.sent = 0  # samples sent (speech and silence)
        self.spoken = 0  # samples of speech sent

    def put(self, data: bytes, encoding: str, sample_rate: int) -> None:
        """Queue the model's audio (:class:`ClientNotReading` past ``max_seconds``)."""
        samples = speech_samples(data, encoding)
        if sample_rate != RATE:
            stream = self.resamplers.get(sample_rate)
            if stream is None:
                stream = self.resamplers[sample_rate] = soxr.ResampleStream(
                    sample_rate, RATE, 1, dtype="float32", quality="HQ")
            samples = stream.resample_chunk(samples)
        if self.queued + samples.shape[0] > self.max_samples:
            raise ClientNotReading(f"{self.queued / RATE:.1f} s of speech wait unplayed")
        pcm = np.clip(np.round(samples * 32767.0), -32768, 32767).astype(np.int16)
        if pcm.shape[0]:
            self.chunks.append(pcm)
            self.queued += pcm.shape[0]

    def mark(self, mark: AudioMark) -> None:
        """Hand ``mark`` to ``on_mark`` once the speech queued before it has been sent."""
        self.chunks.append(mark)

    def clear(self) -> int:
        """Drop the speech (and marks) not yet sent; the samples dropped."""
        dropped = self.queued
        self.chunks.clear()
        self.queued = 0
        self.resamplers.clear()  # the next speech starts afresh, no tail of this one
        return dropped

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` samples, silence where no speech is queued; the marks
        reached on the way handed over."""
        out = np.zeros(count, np.int16)
        filled = 0
        while self.chunks and (filled < count or isinstance(self.chunks[0], AudioMark)):
            chunk = self.chunks[0]
            if isinstance(chunk, AudioMark):
                self.chunks.popleft()
                if self.on_mark is not None:
                    self.on_mark(chunk)
                continue
            step = min(count - filled, chunk.shape[0])
            out[filled:filled + step] = chunk[:step]
            filled += step
            if step == chunk.shape[0]:
                self.chunks.popleft()
            else:
                self.chunks[0] = chunk[step:]
        self.queued -= filled
        self.spoken += filled
        return out

    async def recv(self) -> Any:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self.started is None:
            self.started = now
        else:
            wait = self.started + self.sent / RATE - now
            if wait > 0:
                await asyncio.sleep(wait)
        frame = av.AudioFrame.from_ndarray(self.take(FRAME_SAMPLES).reshape(1, -1),
                                           format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, self.sent, TIME_BASE
        self.sent += FRAME_SAMPLES
        return frame
