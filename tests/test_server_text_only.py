"""The text-only realtime session (``output_modalities: ["text"]``): only the user transcript."""

from __future__ import annotations

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosedOK
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    as_received,
    configure,
    connect,
    expect_error,
    idle_connection,
    recv,
    running,
    send,
    until_closed,
)

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.engine import Engine, load_voicechat
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal

DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
AUDIO = np.concatenate([question_signal(2.0), np.zeros(8000, np.float32)])


@pytest.fixture(scope="module")
def voicechat(tiny_ckpt):
    return load_voicechat(str(tiny_ckpt))


def _server(tiny_ckpt, voicechat, **limits):
    engine = Engine(str(tiny_ckpt), loader=lambda _: voicechat)
    limits = ServerLimits(update_timeout=5, idle_timeout=5, **limits)
    return LiveServer(create_app(tiny_ckpt, limits=limits, engine=engine))


@pytest.fixture(scope="module")
def server(tiny_ckpt, voicechat):
    yield from running(_server(tiny_ckpt, voicechat))


@pytest.fixture
def ws(server):
    yield from idle_connection(server)


@pytest.fixture(scope="module")
def full_transcript(voicechat):
    """A full streaming session's transcript of the audio as the server receives it."""
    stream = voicechat.create_streaming_session()
    received = as_received(AUDIO)
    for start in range(0, len(received), FRAME):
        stream.push_audio(received[start : start + FRAME])
    stream.flush()
    assert stream.transcript  # the fixture's RNNT emits tokens
    return stream.transcript


def _text_only(ws) -> dict:
    return configure(ws, output_modalities=["text"])


def _send_audio(ws, audio: np.ndarray, chunk: int = 4 * FRAME) -> None:
    for start in range(0, len(audio), chunk):
        send(ws, append_message(audio[start : start + chunk]))


def test_session_updated_reports_text_output_only(ws):
    session = _text_only(ws)["session"]
    assert session["output_modalities"] == ["text"]
    assert session["state"] == "ready" and session["frame_samples"] == FRAME


def test_only_transcript_events_stream_and_the_final_equals_a_full_session(ws, full_transcript):
    _text_only(ws)
    _send_audio(ws, AUDIO)
    send(ws, {"type": "input_audio_buffer.commit"})
    events, code = until_closed(ws)
    kinds = [e["type"] for e in events]
    assert code == 1000
    assert set(kinds) == {DELTA, "input_audio_buffer.committed", COMPLETED, "response.done"}
    assert kinds.count(COMPLETED) == 1 and kinds[-2:] == [COMPLETED, "response.done"]
    completed = events[kinds.index(COMPLETED)]
    assert completed["transcript"] == full_transcript
    deltas = [e for e in events if e["type"] == DELTA]
    assert "".join(d["delta"] for d in deltas).strip() == full_transcript
    assert deltas[-1]["transcript"] == full_transcript


def test_an_empty_stream_ends_with_one_empty_final_transcript(ws):
    _text_only(ws)
    send(ws, {"type": "input_audio_buffer.commit"})
    events, code = until_closed(ws)
    assert [e["type"] for e in events] == ["input_audio_buffer.committed", COMPLETED,
                                           "response.done"]
    assert events[1]["transcript"] == ""
    assert code == 1000


def test_audio_after_the_end_of_input_is_not_transcribed(ws):
    _text_only(ws)
    send(ws, {"type": "input_audio_buffer.commit"})
    try:
        send(ws, append_message(AUDIO[: 8 * FRAME]))
    except ConnectionClosedOK:
        pass  # the empty stream's turn ended and closed before the audio went out
    events, code = until_closed(ws)
    kinds = [e["type"] for e in events]
    assert kinds.count(COMPLETED) == 1 and DELTA not in kinds
    assert code == 1000


def test_the_full_session_is_the_default(ws):
    session = configure(ws, output_modalities=["text", "audio"])["session"]
    assert "output_modalities" not in session


@pytest.mark.parametrize("value", [["speech"], "text", [], ["audio"], ["text", "text"]])
def test_bad_output_modalities_fail_the_update_naming_the_field(ws, value):
    recv(ws)
    send(ws, {"type": "session.update", "session": {"output_modalities": value}})
    error = expect_error(ws, "session_initialization_failed")
    assert "output_modalities" in error["error"]["message"]
    _ = _send_and_configure(ws)  # the connection stays usable


def _send_and_configure(ws) -> dict:
    send(ws, {"type": "session.update", "session": {"output_modalities": ["text"]}})
    updated = recv(ws)
    assert updated["type"] == "session.updated", updated
    return updated


def test_tools_need_the_full_session(ws):
    recv(ws)
    send(ws, {"type": "session.update",
              "session": {"output_modalities": ["text"], "tools": []}})
    error = expect_error(ws, "session_initialization_failed")
    assert "session.tools" in error["error"]["message"]


def test_the_transcript_budget_is_an_error_and_the_session_still_commits(tiny_ckpt, voicechat):
    live = _server(tiny_ckpt, voicechat, max_transcript_bytes=1)
    try:
        with connect(live.ws()) as ws:
            _text_only(ws)
            _send_audio(ws, AUDIO)
            send(ws, {"type": "input_audio_buffer.commit"})
            events, code = until_closed(ws)
        errors = [e for e in events if e["type"] == "error"]
        assert errors and "max_transcript_bytes=1" in errors[0]["error"]["message"]
        assert [e["type"] for e in events].count(COMPLETED) == 1
        assert code == 1000
    finally:
        live.stop()


def test_a_text_only_and_a_full_session_run_side_by_side(tiny_ckpt, full_transcript):
    # The engine loads its own model: a full session's lazy warm-start arrays
    # belong to the thread that made them.
    live = LiveServer(create_app(tiny_ckpt, limits=ServerLimits(update_timeout=5, idle_timeout=5,
                                                                max_sessions=2)))
    try:
        with connect(live.ws()) as text_ws, connect(live.ws()) as full_ws:
            _text_only(text_ws)
            configure(full_ws)
            for start in range(0, len(AUDIO), 4 * FRAME):
                for ws in (text_ws, full_ws):
                    send(ws, append_message(AUDIO[start : start + 4 * FRAME]))
            for ws in (text_ws, full_ws):
                send(ws, {"type": "input_audio_buffer.commit"})
            text_events, _ = until_closed(text_ws)
            full_events, _ = until_closed(full_ws)
        completed = [e for e in text_events if e["type"] == COMPLETED]
        assert [e["transcript"] for e in completed] == [full_transcript]
        full_deltas = [e for e in full_events if e["type"] == DELTA]
        assert full_deltas[-1]["transcript"] == full_transcript
        assert "response.audio.delta" in {e["type"] for e in full_events}
        assert "response.audio.delta" not in {e["type"] for e in text_events}
    finally:
        live.stop()
