"""A real aiortc client peer for the WebRTC tests: it offers a microphone track and the
``oai-events`` data channel, signals through the openai SDK's ``realtime.calls``, plays a
question paced in real time once told to, and keeps what it hears and reads.

Every candidate on both sides is on 127.0.0.1 (the server's ``--ice-host`` and the
client's own gathering), and no STUN or TURN server is asked: nothing leaves loopback.
"""

from __future__ import annotations

import asyncio
import fractions
import json
import time
from typing import Any

import numpy as np
import openai
import soxr
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from mlx_voicechat_plugin.server.transport.ice import gathering_on
from mlx_voicechat_plugin.server.transport.rtc_media import FRAME_SAMPLES, RATE, mono_pcm16
from mlx_voicechat_plugin.testing.fixtures import question_signal

LOOPBACK = ("127.0.0.1",)
TIMEOUT = 20.0


def question_48k(seconds: float, silence: float = 0.0) -> np.ndarray:
    """The fixtures' question at 48 kHz (PCM16 values), then ``silence`` seconds of zeros."""
    samples = soxr.resample(question_signal(seconds), 16_000, RATE)
    pcm = np.round(np.clip(samples, -1, 1) * 32767).astype(np.int16)
    return np.concatenate([pcm, np.zeros(int(silence * RATE), np.int16)])


def opus_round_trip(samples: np.ndarray) -> np.ndarray:
    """``samples`` (PCM16 at 48 kHz) through aiortc's own Opus encoder and decoder, as a
    call's microphone audio goes, in 20 ms frames."""
    import av
    from aiortc.codecs.opus import OpusDecoder, OpusEncoder
    from aiortc.jitterbuffer import JitterFrame

    encoder, decoder, out = OpusEncoder(), OpusDecoder(), []
    for start in range(0, samples.shape[0], FRAME_SAMPLES):
        frame = av.AudioFrame.from_ndarray(samples[start:start + FRAME_SAMPLES].reshape(1, -1),
                                           format="s16", layout="mono")
        frame.sample_rate, frame.pts = RATE, start
        frame.time_base = fractions.Fraction(1, RATE)
        payloads, timestamp = encoder.encode(frame)
        for payload in payloads:
            out += [mono_pcm16(f) for f in decoder.decode(JitterFrame(payload, timestamp))]
    return np.frombuffer(b"".join(out), dtype="<i2")


class Microphone(MediaStreamTrack):
    """Sends nothing until :attr:`go` is set, then ``samples`` in 20 ms frames in real
    time, then ends (the sender stops)."""

    kind = "audio"

    def __init__(self, samples: np.ndarray):
        super().__init__()
        self.samples, self.sent, self.started = samples, 0, None
        self.go = asyncio.Event()
        self.finished = asyncio.Event()

    async def recv(self) -> Any:
        import av

        await self.go.wait()
        if self.sent >= self.samples.shape[0]:
            self.finished.set()
            raise MediaStreamError
        if self.started is None:
            self.started = time.monotonic()
        wait = self.started + self.sent / RATE - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        chunk = np.zeros(FRAME_SAMPLES, np.int16)
        part = self.samples[self.sent:self.sent + FRAME_SAMPLES]
        chunk[:part.shape[0]] = part
        frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = RATE, self.sent
        frame.time_base = fractions.Fraction(1, RATE)
        self.sent += FRAME_SAMPLES
        return frame


class Caller:
    """One call from a client peer; ``events`` are the data channel's, ``heard`` the
    server's track (PCM16 at 48 kHz)."""

    def __init__(self, base_url: str, api_key: str, samples: np.ndarray | None = None,
                 audio: bool = True):
        self.client = openai.AsyncOpenAI(api_key=api_key, base_url=base_url)
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.channel = self.pc.createDataChannel("oai-events")
        self.events: list[dict] = []
        self.arrived = asyncio.Event()
        self.opened = asyncio.Event()
        self.heard: list[bytes] = []
        self.microphone = Microphone(samples if samples is not None else np.zeros(0, np.int16))
        if audio:
            self.pc.addTrack(self.microphone)
        self.channel.on("open", self.opened.set)
        self.channel.on("message", self._on_message)
        self.pc.on("track", lambda track: asyncio.ensure_future(self._listen(track)))
        self.call_id: str | None = None
        self.location: str | None = None

    def _on_message(self, message: str) -> None:
        self.events.append(json.loads(message))
        self.arrived.set()

    async def _listen(self, track: Any) -> None:
        while True:
            try:
                self.heard.append(mono_pcm16(await track.recv()))
            except MediaStreamError:
                return

    async def offer(self) -> str:
        with gathering_on(LOOPBACK):
            await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def dial(self, session: dict | None = None, sdp: str | None = None) -> None:
        """Signal through the SDK (``raise``s its ``APIStatusError`` when refused)."""
        params: dict[str, Any] = {"sdp": sdp or await self.offer()}
        if session is not None:
            params["session"] = session
        raw = await self.client.realtime.calls.with_raw_response.create(**params)
        self.location = raw.headers["location"]
        self.call_id = self.location.rsplit("/", 1)[1]
        answer = raw.parse().text
        await self.pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
        await asyncio.wait_for(self.opened.wait(), TIMEOUT)

    async def until(self, kind: str, timeout: float = TIMEOUT) -> dict:
        """The first event of type ``kind`` (read so far or next)."""
        async def wait() -> dict:
            while True:
                found = [e for e in self.events if e["type"] == kind]
                if found:
                    return found[0]
                self.arrived.clear()
                await self.arrived.wait()
        return await asyncio.wait_for(wait(), timeout)

    def send(self, payload: dict | str) -> None:
        self.channel.send(payload if isinstance(payload, str) else json.dumps(payload))

    async def quiet(self, seconds: float, limit: float = 60.0) -> None:
        """Wait until no event and no speech came for ``seconds`` (at most ``limit``)."""
        end = time.monotonic() + limit
        last = (len(self.events), self.speech_samples())
        still = time.monotonic()
        while time.monotonic() < end and time.monotonic() - still < seconds:
            await asyncio.sleep(0.1)
            now = (len(self.events), self.speech_samples())
            if now != last:
                last, still = now, time.monotonic()

    def audio(self) -> np.ndarray:
        return np.frombuffer(b"".join(self.heard), dtype="<i2")

    def speech_samples(self) -> int:
        """Samples heard that are not (near) silence."""
        return int(np.count_nonzero(np.abs(self.audio()) > 64))

    async def hang_up(self) -> None:
        if self.call_id is not None:
            await self.client.realtime.calls.hangup(self.call_id)

    async def close(self) -> None:
        await self.pc.close()
        await self.client.close()
