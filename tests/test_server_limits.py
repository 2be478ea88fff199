"""Server limits: message size, session length, update and idle timeouts."""

from __future__ import annotations

import time

import numpy as np
import pytest
from server_support import (
    FRAME,
    LiveServer,
    append_message,
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
from mlx_voicechat_plugin.server.limits import TRANSPORT_SLACK_BYTES, ServerLimits

LIMITS = ServerLimits(max_message_bytes=8192, max_session_seconds=0.16,
                      update_timeout=0.5, idle_timeout=0.5)


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    app = create_app(tiny_ckpt, limits=LIMITS)
    yield from running(LiveServer(app, ws_max_size=LIMITS.transport_max_bytes))


@pytest.fixture
def ws(server):
    yield from idle_connection(server)


def test_limits_reject_non_positive_values():
    for field in ("max_message_bytes", "max_session_seconds", "update_timeout", "idle_timeout"):
        with pytest.raises(ValueError):
            ServerLimits(**{field: 0})


def test_a_message_over_the_limit_is_rejected_before_decoding_and_the_loop_continues(ws):
    recv(ws)
    send(ws, "x" * (LIMITS.max_message_bytes + 1))  # not JSON: size is checked first
    error = expect_error(ws, "invalid_request")
    assert "exceeds" in error["error"]["message"]
    send(ws, {"type": "session.ping"})
    assert recv(ws)["type"] == "session.pong"


def test_a_message_over_the_transport_cap_closes_with_1009(ws):
    recv(ws)
    send(ws, "x" * (LIMITS.max_message_bytes + TRANSPORT_SLACK_BYTES + 1))
    assert until_closed(ws)[1] == 1009


def test_session_length_is_capped_by_max_session_seconds(ws):
    updated = configure(ws, max_streaming_seconds=100.0)
    assert updated["session"]["max_streaming_seconds"] == pytest.approx(0.16)
    for _ in range(3):  # one frame a message keeps each under the size limit
        send(ws, append_message(np.zeros(FRAME, np.float32)))
    audio = 0
    while (event := recv(ws))["type"] != "error":
        audio += event["type"] == "response.audio.delta"
    # Two frames ran; the second's audio waits for the stream's end (commit).
    assert event["error"]["code"] == "inference_error" and audio == 1


def test_no_session_update_within_the_update_timeout_closes_with_1008(ws):
    recv(ws)
    started = time.monotonic()
    send(ws, {"type": "session.ping"})
    assert recv(ws)["type"] == "session.pong"
    error = expect_error(ws, "invalid_request")
    assert "session.update" in error["error"]["message"]
    assert until_closed(ws)[1] == 1008
    assert 0.4 < time.monotonic() - started < 3.0


def test_an_idle_session_closes_with_1008_and_pings_do_not_count(ws):
    configure(ws)
    started = time.monotonic()
    events = []
    try:
        while time.monotonic() - started < 3.0:
            send(ws, {"type": "session.ping"})
            time.sleep(0.1)
            while True:
                try:
                    events.append(recv(ws, timeout=0.01))
                except TimeoutError:
                    break
    except Exception:
        pass
    errors = [e for e in events if e["type"] == "error"]
    assert errors and errors[0]["error"]["code"] == "invalid_request"
    assert "idle" in errors[0]["error"]["message"]
    assert ws.close_code == 1008
    assert time.monotonic() - started < 2.0


def test_a_timed_out_connection_releases_the_session(server):
    server.wait_idle()
    with connect(server.ws()) as first:
        recv(first)
        assert until_closed(first, timeout=3.0)[1] == 1008
    with connect(server.ws()) as second:
        configure(second)


@pytest.fixture
def slow_server(tiny_ckpt, monkeypatch):
    """Idle after 0.5 s, on an engine that takes 0.1 s over each frame (a loaded machine)."""
    from mlx_voicechat_plugin.runtime.streaming import StreamingShell

    check = StreamingShell.check_frame

    def slow_check(self):
        time.sleep(0.1)
        check(self)

    monkeypatch.setattr(StreamingShell, "check_frame", slow_check)
    limits = ServerLimits(update_timeout=5, idle_timeout=0.5)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits)))


def test_a_backlog_the_server_still_works_on_is_not_idle(slow_server):
    """Twelve frames sent at once take the slow engine over 1 s: every one is answered before
    the idle close, which counts from the last frame the server took."""
    frames = 12
    with connect(slow_server.ws()) as ws:
        configure(ws)
        for _ in range(frames):
            send(ws, append_message(np.zeros(FRAME, np.float32)))
        started, audio = time.monotonic(), 0
        while (event := recv(ws, timeout=10))["type"] != "error":
            audio += event["type"] == "response.audio.delta"
        assert "idle" in event["error"]["message"]
        assert time.monotonic() - started > 1.0
        assert audio >= frames - 1  # the last frame's audio waits for a commit
        assert until_closed(ws)[1] == 1008
