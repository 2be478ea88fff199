"""The live server for the OpenAI Realtime GA tests, and a question in 24 kHz PCM16."""

from __future__ import annotations

import wave
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import soxr
from server_support import LiveServer, running
from tool_support import VALID, WEATHER, Script, short_tool_prompt

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal

API_KEY = "test-key"  # GA clients always send a bearer token; the server checks it
MODEL = "tiny"  # the fixture checkpoint's directory name: what ?model= must say
GA_RATE = 24_000
TOOL = {"type": "function", **WEATHER}  # a GA session tool
CHUNK_MS = 100


def ga_server(checkpoint: Path):
    """Fixture body: one live server (API key on) for a test module."""
    limits = ServerLimits(update_timeout=10, idle_timeout=10)
    yield from running(LiveServer(create_app(checkpoint, api_key=API_KEY, limits=limits)))


def base_url(server: LiveServer) -> str:
    """What a GA client is given as its base URL (it appends ``/realtime``)."""
    return server.http("/openai/v1")


def question_wav_24k(path: Path, seconds: float) -> Path:
    """The fixtures' question signal, resampled to 24 kHz, as a PCM16 WAV file."""
    samples = soxr.resample(question_signal(seconds), 16_000, GA_RATE)
    pcm = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(GA_RATE)
        out.writeframes(pcm.tobytes())
    return path


def wav_chunks(path: Path, ms: int = CHUNK_MS) -> list[bytes]:
    """The WAV's PCM16 bytes in ``ms`` chunks (it must be 24 kHz mono)."""
    with wave.open(str(path), "rb") as wav:
        assert (wav.getframerate(), wav.getnchannels()) == (GA_RATE, 1)
        data = wav.readframes(wav.getnframes())
    step = GA_RATE * ms // 1000 * 2
    return [data[i : i + step] for i in range(0, len(data), step)]


def silence_chunks(seconds: float, ms: int = CHUNK_MS) -> list[bytes]:
    step = GA_RATE * ms // 1000 * 2
    return [bytes(step)] * int(round(seconds * 1000 / ms))


def scripted_call(server: LiveServer, monkeypatch, text: str = VALID) -> Script:
    """The function head emits ``text`` (a get_weather call) from generated frame 2 on."""
    short_tool_prompt(monkeypatch)
    voicechat = server.app.state.engine.voicechat
    return Script(voicechat.tokenizer, voicechat.config.pad_token_id, text).install(monkeypatch)


def call_frames(script: Script) -> int:
    """Frames of audio after which the scripted call is complete."""
    return script.start + len(script.tokens) + 1


@contextmanager
def scripted_question(server: LiveServer, tmp_path_factory, name: str):
    """``(script, wav)``: a get_weather call scripted (undone after) and a 24 kHz question
    long enough for it, the server idle."""
    import _pytest.monkeypatch

    patch = _pytest.monkeypatch.MonkeyPatch()
    try:
        script = scripted_call(server, patch)
        wav = question_wav_24k(tmp_path_factory.mktemp(name) / "q24k.wav",
                               call_frames(script) * 0.08 + 0.5)
        server.wait_idle()
        yield script, wav
    finally:
        patch.undo()
