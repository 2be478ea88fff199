"""The realtime protocol over a real WebSocket: messages, events and errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
from server_support import (
    FRAME,
    FailingVoiceChat,
    LiveServer,
    append_message,
    configure,
    connect,
    decode_audio,
    expect_error,
    idle_connection,
    recv,
    running,
    send,
    until_closed,
)

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal

EVENT_ID = re.compile(r"^event_[0-9a-f]{16}$")
SESSION_ID = re.compile(r"^sess_[0-9a-f]{16}$")


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=5, idle_timeout=5)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits)))


@pytest.fixture
def ws(server):
    yield from idle_connection(server)


def test_session_created_announces_a_session_in_configuring_state(ws):
    created = recv(ws)
    assert created["type"] == "session.created"
    assert EVENT_ID.match(created["event_id"])
    session = created["session"]
    assert SESSION_ID.match(session["id"])
    assert session["state"] == "configuring"
    assert session["input_audio_format"]["sample_rate"] == 16000
    assert session["output_audio_format"]["sample_rate"] == 22050


def test_session_updated_reports_the_served_model_whatever_the_client_asked(ws):
    updated = configure(ws, model="../../some/other/model", seed=3)
    session = updated["session"]
    assert session["state"] == "ready"
    assert session["model"] == "tiny"
    assert session["frame_samples"] == FRAME
    assert session["input_audio_format"]["type"] == "pcm16"


def test_ping_is_answered_before_and_after_configuration(ws):
    recv(ws)
    send(ws, {"type": "session.ping"})
    assert recv(ws)["type"] == "session.pong"
    send(ws, {"type": "session.update", "session": {}})
    assert recv(ws)["type"] == "session.updated"
    send(ws, {"type": "session.ping"})
    assert recv(ws)["type"] == "session.pong"


def test_audio_before_session_update_is_an_invalid_request(ws):
    recv(ws)
    send(ws, append_message(np.zeros(FRAME, np.float32)))
    error = expect_error(ws, "invalid_request")
    assert error["error"]["message"] == "send session.update before audio"
    send(ws, {"type": "input_audio_buffer.commit"})
    expect_error(ws, "invalid_request")


@pytest.mark.parametrize("frame", ['{"type": "no.such.event"}', "[1, 2]", "{not json", b"\x00\x01"],
                         ids=["unknown-type", "non-object", "invalid-json", "binary"])
def test_malformed_messages_are_invalid_requests_and_the_loop_continues(ws, frame):
    recv(ws)
    send(ws, frame)
    expect_error(ws, "invalid_request")
    send(ws, {"type": "session.ping"})
    assert recv(ws)["type"] == "session.pong"


def test_errors_echo_only_a_short_prefix_of_client_values(ws):
    recv(ws)
    send(ws, {"type": "A" * 10_000})
    error = expect_error(ws, "invalid_request")
    assert len(error["error"]["message"]) < 100


def test_a_second_session_update_is_an_invalid_request(ws):
    configure(ws)
    send(ws, {"type": "session.update", "session": {}})
    expect_error(ws, "invalid_request")


@pytest.mark.parametrize("session", [{"seed": -1}, {"seed": "7"}, {"seed": True},
                                     {"max_streaming_seconds": 0}, {"system_prompt": 5},
                                     "not-an-object"])
def test_invalid_session_fields_fail_initialization_and_the_client_may_retry(ws, session):
    recv(ws)
    send(ws, {"type": "session.update", "session": session})
    expect_error(ws, "session_initialization_failed")
    send(ws, {"type": "session.update", "session": {"seed": 1}})
    assert recv(ws)["type"] == "session.updated"


@pytest.mark.parametrize("message", [
    {"type": "input_audio_buffer.append", "audio": "***not base64***"},
    {"type": "input_audio_buffer.append", "audio": "AAAA"},  # 3 bytes
    {"type": "input_audio_buffer.append", "audio": "AAAAAAAA", "sample_rate": 44100},
    {"type": "input_audio_buffer.append", "audio": "AAAAAAAA", "sample_rate": "16000"},
], ids=["bad-base64", "odd-bytes", "wrong-rate", "non-integer-rate"])
def test_bad_audio_is_an_inference_error_and_the_loop_continues(ws, message):
    configure(ws)
    send(ws, message)
    expect_error(ws, "inference_error")
    send(ws, {"type": "session.ping"})
    assert recv(ws)["type"] == "session.pong"


def test_append_streams_each_frames_events_in_frame_order(ws):
    configure(ws)
    # A frame's audio leaves once the next frame is decoded: 4 frames, 3 deltas.
    send(ws, append_message(question_signal(4 * FRAME / 16000)))
    events = []
    audio = []
    while len(audio) < 3:
        event = recv(ws)
        events.append(event)
        if event["type"] == "response.audio.delta":
            audio.append(event)
    assert [e["frame_index"] for e in audio] == [0, 1, 2]
    indices = [e["frame_index"] for e in events]
    assert indices == sorted(indices)
    first = audio[0]
    assert (first["format"], first["sample_rate"], first["channels"]) == ("pcm16", 22050, 1)
    assert len(first["audio_codes"]) > 0
    assert decode_audio(first).shape == decode_audio(audio[1]).shape == (1764,)
    for event in events:
        assert EVENT_ID.match(event["event_id"])
        if event["type"] == "response.text.delta":
            assert {"delta", "text", "token_id", "frame_index"} <= event.keys()
        if event["type"] == "conversation.item.input_audio_transcription.delta":
            assert {"delta", "transcript", "frame_index"} <= event.keys()


def test_commit_sends_committed_the_flushed_events_done_and_closes_normally(ws):
    configure(ws)
    send(ws, append_message(question_signal(1.5 * FRAME / 16000)))
    send(ws, {"type": "input_audio_buffer.commit"})
    events, code = until_closed(ws)
    kinds = [e["type"] for e in events]
    assert "input_audio_buffer.committed" in kinds
    assert kinds[-1] == "response.done"
    assert code == 1000
    audio = [e for e in events if e["type"] == "response.audio.delta"]
    # One audio delta per frame, the held codec tail inside the last one.
    assert [e["frame_index"] for e in audio] == list(range(len(audio)))
    assert all(len(e["audio_codes"]) == 31 and decode_audio(e).shape == (1764,) for e in audio)
    assert audio[-1]["frame_index"] == 1
    assert events[-1]["frame_index"] == 2  # the padded partial frame ran


def test_commit_without_padding_drops_the_partial_frame(ws):
    configure(ws)
    send(ws, append_message(np.zeros(FRAME // 2, np.float32)))
    send(ws, {"type": "input_audio_buffer.commit", "pad_partial": False})
    events, code = until_closed(ws)
    assert [e["type"] for e in events] == ["input_audio_buffer.committed", "response.done"]
    assert events[-1]["frame_index"] == 0 and code == 1000


@pytest.mark.parametrize("kind", ["session.cancel", "response.cancel"])
def test_cancel_sends_cancelled_and_closes_normally(ws, kind):
    configure(ws)
    send(ws, {"type": kind})
    events, code = until_closed(ws)
    assert [e["type"] for e in events] == ["response.cancelled"]
    assert code == 1000


def test_the_session_is_free_for_the_next_client_as_soon_as_commit_closes(server):
    server.wait_idle()
    for _ in range(2):
        with connect(server.ws()) as client:
            configure(client)
            send(client, {"type": "input_audio_buffer.commit"})
            assert until_closed(client)[1] == 1000


def test_a_second_connection_is_busy_while_the_first_holds_the_session(server):
    server.wait_idle()
    with connect(server.ws()) as first:
        configure(first)
        with connect(server.ws()) as second:
            expect_error(second, "server_busy")
            assert until_closed(second)[1] == 1013
        send(first, {"type": "session.cancel"})
        assert until_closed(first)[1] == 1000


def test_a_disconnect_releases_the_session(server):
    server.wait_idle()
    with connect(server.ws()) as first:
        configure(first)
        send(first, append_message(np.zeros(3 * FRAME, np.float32)))
        recv(first)
    server.wait_idle()
    with connect(server.ws()) as second:
        configure(second)


def test_a_stream_past_max_streaming_seconds_is_an_inference_error(ws):
    updated = configure(ws, max_streaming_seconds=0.16)
    assert updated["session"]["max_streaming_seconds"] == pytest.approx(0.16)
    send(ws, append_message(np.zeros(4 * FRAME, np.float32)))
    audio = 0
    while True:
        event = recv(ws)
        if event["type"] == "error":
            assert event["error"]["code"] == "inference_error"
            break
        audio += event["type"] == "response.audio.delta"
    assert audio == 1  # frame 1's audio is completed by the commit
    send(ws, {"type": "input_audio_buffer.commit"})
    events, code = until_closed(ws)
    assert [e["frame_index"] for e in events if e["type"] == "response.audio.delta"] == [1]
    assert events[-1]["type"] == "response.done" and code == 1000


def test_a_model_failure_is_an_inference_error_that_stops_the_append(tiny_ckpt):
    from mlx_voicechat_plugin.server.engine import Engine, load_voicechat

    engine = Engine(str(tiny_ckpt), loader=lambda path: FailingVoiceChat(
        load_voicechat(path), fails=lambda stream: stream.frame_index >= 1))  # fails on frame 2
    live = LiveServer(create_app(tiny_ckpt, engine=engine))
    try:
        with connect(live.ws()) as ws:
            configure(ws)
            send(ws, append_message(np.zeros(3 * FRAME, np.float32)))
            events = []
            while not events or events[-1]["type"] != "error":
                events.append(recv(ws))
            assert events[-1]["error"]["code"] == "inference_error"
            assert "model exploded" in events[-1]["error"]["message"]
            assert {e["frame_index"] for e in events[:-1]} == {0}
            send(ws, {"type": "session.ping"})
            assert recv(ws)["type"] == "session.pong"  # nothing from frame 2 came first
    finally:
        live.stop()


def test_the_mlx_cache_is_cleared_when_a_session_closes_not_per_frame(server, monkeypatch):
    from mlx_voicechat_plugin.server.engine import thread as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "_clear_cache", lambda: calls.append(1))
    server.wait_idle()
    with connect(server.ws()) as ws:
        configure(ws)
        send(ws, append_message(np.zeros(3 * FRAME, np.float32)))
        send(ws, {"type": "input_audio_buffer.commit"})
        until_closed(ws)
    assert calls == [1]
