"""Protocol fuzzing: malformed client messages never crash the handler or leak internals.

Each example runs on one connection: it sends the junk, checks the documented
error code, then checks the session still works (a ping gets a pong; once
configured, a valid append still yields audio).
"""

from __future__ import annotations

import base64
import json
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    connect,
    recv,
    running,
    send,
)

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits

EXAMPLES = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
# Server internals a client must never see: tracebacks, source files, our paths.
REPO = re.escape(str(Path(__file__).resolve().parents[1]))
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/site-packages/|" + REPO + r"|line \d+")
REQUEST_TYPES = ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "session.cancel", "response.cancel", "session.ping", "conversation.item.create"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=10, idle_timeout=10)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits)))


def _clean(event: dict) -> dict:
    raw = json.dumps(event)
    assert not LEAKS.search(raw), raw
    return event


def _answer(ws) -> dict:
    return _clean(recv(ws))


def _still_pongs(ws) -> None:
    send(ws, {"type": "session.ping"})
    assert _answer(ws)["type"] == "session.pong"


def _still_streams(ws) -> None:
    # A frame's audio leaves when the next frame is decoded: two frames.
    send(ws, append_message(np.zeros(2 * FRAME, np.float32)))
    while (event := _answer(ws))["type"] != "response.audio.delta":
        assert event["type"] != "error", event


@contextmanager
def _unconfigured(server):
    server.wait_idle()
    with connect(server.ws()) as ws:
        assert _answer(ws)["type"] == "session.created"
        yield ws


@given(frame=st.one_of(
    st.binary(max_size=64),  # binary frames
    st.text(max_size=64),  # arbitrary text, mostly not JSON
    junk.map(json.dumps),  # JSON that is not a known message
    st.dictionaries(st.sampled_from(["type", "audio", "session", "item", "x"]), junk,
                    max_size=4).map(json.dumps)))
@EXAMPLES
def test_junk_before_configuration_is_an_invalid_request_and_the_loop_continues(server, frame):
    if isinstance(frame, str):
        try:
            message = json.loads(frame)
        except ValueError:
            message = None
        if isinstance(message, dict) and message.get("type") in REQUEST_TYPES:
            return  # a real message; covered by the protocol tests
    with _unconfigured(server) as ws:
        send(ws, frame)
        event = _answer(ws)
        assert event["type"] == "error"
        assert event["error"]["code"] == "invalid_request"
        _still_pongs(ws)


@given(session=junk, extra=st.dictionaries(st.text(max_size=8), junk, max_size=3))
@EXAMPLES
def test_mutated_session_update_either_configures_or_fails_initialization(server, session, extra):
    with _unconfigured(server) as ws:
        send(ws, {**extra, "type": "session.update", "session": session})
        event = _answer(ws)
        if event["type"] == "error":
            assert event["error"]["code"] == "session_initialization_failed"
            _still_pongs(ws)
            configure_again = {"type": "session.update", "session": {}}
            send(ws, configure_again)
            assert _answer(ws)["type"] == "session.updated"
        else:
            assert event["type"] == "session.updated"
        _still_pongs(ws)
        _still_streams(ws)


bad_audio = st.one_of(
    junk.filter(lambda v: not isinstance(v, str)),
    st.binary(min_size=1, max_size=33).filter(lambda b: len(b) % 2)
    .map(lambda b: base64.b64encode(b).decode()),  # odd byte counts
    st.binary(min_size=3, max_size=30).map(lambda b: base64.b64encode(b).decode()[:-1]),
    st.text(alphabet="!@#$%^&*()é\u0000", min_size=1, max_size=20))


@given(audio=bad_audio, extra=st.dictionaries(st.sampled_from(["x", "frame", "format"]), junk,
                                              max_size=2))
@EXAMPLES
def test_bad_audio_is_an_inference_error_and_a_valid_append_still_yields_audio(server, audio,
                                                                               extra):
    with _unconfigured(server) as ws:
        send(ws, {"type": "session.update", "session": {}})
        assert _answer(ws)["type"] == "session.updated"
        send(ws, {**extra, "type": "input_audio_buffer.append", "audio": audio})
        event = _answer(ws)
        assert event["type"] == "error" and event["error"]["code"] == "inference_error"
        _still_pongs(ws)
        _still_streams(ws)


@given(rate=junk.filter(lambda v: v != 16000 or isinstance(v, bool) or isinstance(v, float)))
@EXAMPLES
def test_a_bad_sample_rate_is_an_inference_error(server, rate):
    with _unconfigured(server) as ws:
        send(ws, {"type": "session.update", "session": {}})
        assert _answer(ws)["type"] == "session.updated"
        send(ws, {"type": "input_audio_buffer.append", "audio": "AAAA" * 2, "sample_rate": rate})
        event = _answer(ws)
        assert event["type"] == "error" and event["error"]["code"] == "inference_error"
        _still_streams(ws)


@given(pad=junk.filter(lambda v: not isinstance(v, bool)))
@EXAMPLES
def test_a_non_boolean_pad_partial_is_an_invalid_request(server, pad):
    with _unconfigured(server) as ws:
        send(ws, {"type": "session.update", "session": {}})
        assert _answer(ws)["type"] == "session.updated"
        send(ws, {"type": "input_audio_buffer.commit", "pad_partial": pad})
        event = _answer(ws)
        assert event["type"] == "error" and event["error"]["code"] == "invalid_request"
        _still_streams(ws)


def test_invalid_utf8_in_a_text_frame_closes_the_connection_not_the_server(server):
    from raw_client import RawClient

    server.wait_idle()
    client = RawClient(server.port)
    try:
        client.send_frame(b'{"type": "\xff\xfe"}')
        closing = client.close_frame()
        assert closing is None or closing[0] == 1007
    finally:
        client.close()
    server.wait_idle()
    with connect(server.ws()) as ws:
        assert _answer(ws)["type"] == "session.created"
        _still_pongs(ws)
