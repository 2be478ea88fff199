"""What streams over the WebSocket is what the in-process session produces."""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    as_received,
    configure,
    connect,
    decode_audio,
    running,
    send,
    until_closed,
)

from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.runtime.audio import to_pcm16, write_wav
from mlx_voicechat_plugin.runtime.events import (
    AssistantTextDelta,
    Audio,
    FunctionDelta,
    UserTranscriptDelta,
)
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.testing.fixtures import question_signal

ROOT = Path(__file__).resolve().parents[1]
SEED = 5
PROMPT = "You are a helpful assistant."


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from running(LiveServer(create_app(tiny_ckpt)))


def in_process(ckpt: Path, audio: np.ndarray) -> dict:
    model, processor = load(ckpt)
    stream = model.create_session(processor).create_streaming_session(
        system_prompt=PROMPT, seed=SEED)
    events = []
    for start in range(0, len(audio), FRAME):
        events += stream.push_audio(audio[start : start + FRAME])
    events += stream.flush()
    audio_events = [e for e in events if isinstance(e, Audio)]
    return {
        "transcript": stream.transcript, "text": stream.text, "function": stream.function_text,
        "text_deltas": [(e.frame_index, e.token_id, e.delta) for e in events
                        if isinstance(e, AssistantTextDelta)],
        "transcript_deltas": [(e.frame_index, e.delta) for e in events
                              if isinstance(e, UserTranscriptDelta)],
        "function_deltas": [e.token_id for e in events if isinstance(e, FunctionDelta)],
        "frames": sum(e.audio_codes.size > 0 for e in audio_events),
        "codes": [e.audio_codes.tolist() for e in audio_events],
        "pcm": np.concatenate([to_pcm16(e.samples) for e in audio_events]),
    }


def over_websocket(server: LiveServer, audio: np.ndarray) -> dict:
    server.wait_idle()
    with connect(server.ws()) as ws:
        configure(ws, system_prompt=PROMPT, seed=SEED)
        for start in range(0, len(audio), FRAME):
            send(ws, append_message(audio[start : start + FRAME]))
        send(ws, {"type": "input_audio_buffer.commit"})
        events, code = until_closed(ws)
    assert code == 1000

    def of(kind: str) -> list[dict]:
        return [e for e in events if e["type"] == kind]

    text = of("response.text.delta")
    heard = of("conversation.item.input_audio_transcription.delta")
    function = of("response.function.delta")
    audio_events = of("response.audio.delta")
    return {
        "transcript": heard[-1]["transcript"] if heard else "", "text": text[-1]["text"] if text else "",
        "function": function[-1]["text"] if function else "",
        "text_deltas": [(e["frame_index"], e["token_id"], e["delta"]) for e in text],
        "transcript_deltas": [(e["frame_index"], e["delta"]) for e in heard],
        "function_deltas": [e["token_id"] for e in function],
        "frames": sum(bool(e["audio_codes"]) for e in audio_events),
        "codes": [e["audio_codes"] for e in audio_events],
        "pcm": np.concatenate([decode_audio(e) for e in audio_events]),
    }


def test_the_websocket_stream_equals_the_in_process_session(server, tiny_ckpt):
    audio = as_received(np.concatenate([question_signal(1.5), np.zeros(8000, np.float32)]))
    expected, got = in_process(tiny_ckpt, audio), over_websocket(server, audio)
    assert expected["frames"] == got["frames"] == -(-len(audio) // FRAME)
    for key in ("transcript", "text", "function", "text_deltas", "transcript_deltas",
                "function_deltas", "codes"):
        assert got[key] == expected[key], key
    np.testing.assert_array_equal(got["pcm"], expected["pcm"])
    assert expected["transcript"] and expected["text"]


def test_the_file_client_writes_the_spoken_answer(server, tmp_path):
    question = tmp_path / "question.wav"
    write_wav(question, question_signal(1.0, sample_rate=24_000), 24_000)
    answer = tmp_path / "answer.wav"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "file_client.py"), server.ws(), str(question),
         str(answer), "--seed", "1", "--extra-seconds", "0.5"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "[user] " in result.stdout and "[assistant] " in result.stdout
    with wave.open(str(answer), "rb") as handle:
        layout = (handle.getframerate(), handle.getnchannels(), handle.getsampwidth())
        assert layout == (22050, 1, 2)
        frames = -(-int(1.5 * 16000) // FRAME)
        assert handle.getnframes() == frames * 1764
