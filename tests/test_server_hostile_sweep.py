"""No input is a 500 (issue 63): hypothesis-made hostile inputs to every HTTP route and
upgrade of a server with an API key (uploads with made-up WAV headers, mint bodies, SDP
offers, resume query strings) and to each GA client event's fields. Each answer is a
4xx with an error body (or a success), never a 5xx; a WebSocket is never closed 1011;
the server logs no traceback; a clean session still answers afterwards.
"""

from __future__ import annotations

import json
import logging
import struct

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_support import LiveServer, connect, recv, running, send
from websockets.exceptions import ConnectionClosed, InvalidStatus

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.dialects.ga.dialect import CLIENT_EVENTS
from mlx_voicechat_plugin.server.limits import ServerLimits

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GA = "/openai/v1/realtime"
SWEEP = settings(max_examples=25, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=5),
    max_leaves=20)
# Strings as attackers write them: other scripts' digits, huge numbers, controls.
odd_text = st.one_of(st.text(max_size=30), st.sampled_from([
    "\u0663", "\uff11", "1" * 5000, "-1", "1e3", " 1", "0x10", "\x00", "%00", "9" * 25]))


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(max_failed_updates=1000, update_timeout=60, idle_timeout=60)
    app = create_app(tiny_ckpt, api_key=API_KEY, limits=limits)
    yield from running(LiveServer(app, ws_max_size=limits.transport_max_bytes))


@pytest.fixture(autouse=True)
def no_traceback(caplog):
    caplog.set_level(logging.INFO)
    yield
    crashes = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not crashes, [r.getMessage() for r in crashes][:3]


def no_server_error(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert "error" in response.json()


def wav(code: int, channels: int, rate: int, bits: int, data: bytes) -> bytes:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", code, channels, rate, (rate * block) & 0xFFFFFFFF,
                      block & 0xFFFF, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" \
        + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


@SWEEP
@given(code=st.integers(0, 0xFFFF), channels=st.integers(0, 8),
       rate=st.integers(0, 2**32 - 1), bits=st.sampled_from([0, 4, 8, 12, 16, 24, 32, 64]),
       data=st.binary(max_size=64))
def test_uploads_with_any_wav_header_are_never_a_500(server, code, channels, rate, bits, data):
    response = httpx.post(server.http("/v1/audio/transcriptions"), headers=AUTH,
                          files={"file": ("a.wav", wav(code, channels, rate, bits, data))},
                          timeout=60)
    no_server_error(response)


@SWEEP
@given(data=st.binary(max_size=200), fields=st.dictionaries(
    st.sampled_from(["model", "language", "response_format", "temperature", "prompt",
                     "max_new_tokens", "stream", "x"]), odd_text, max_size=4))
def test_uploads_of_any_bytes_and_fields_are_never_a_500(server, data, fields):
    response = httpx.post(server.http("/v1/audio/transcriptions"), headers=AUTH,
                          files={"file": ("f", data)}, data=fields, timeout=60)
    no_server_error(response)


@SWEEP
@given(body=json_values | st.fixed_dictionaries({
    "expires_after": json_values, "session": json_values}))
def test_mint_requests_of_any_json_are_never_a_500(server, body):
    response = httpx.post(server.http(GA + "/client_secrets"), headers=AUTH,
                          content=json.dumps(body), timeout=30)
    no_server_error(response)


SDP_LINES = st.sampled_from([
    "m=audio 9 UDP/TLS/RTP/SAVPF 111", "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
    "m=video 9 UDP/TLS/RTP/SAVPF 96", "a=mid:0", "a=mid:0", "a=rtpmap:111 opus/48000/2",
    "a=sendrecv", "c=IN IP4 0.0.0.0", "a=ice-ufrag:x", "a=ice-pwd:" + "y" * 24,
    "a=fingerprint:sha-256 " + ":".join(["AB"] * 32), "a=setup:actpass", "a=sctp-port:5000",
    "a=group:BUNDLE 0 1", "t=0 0", "s=-", "o=- 1 1 IN IP4 127.0.0.1"])


@SWEEP
@given(lines=st.lists(SDP_LINES | st.text(max_size=30), max_size=40),
       repeat=st.integers(1, 40))
def test_sdp_offers_of_any_lines_are_never_a_500(server, lines, repeat):
    pytest.importorskip("aiortc")
    offer = "v=0\r\n" + "\r\n".join(lines * repeat) + "\r\n"
    response = httpx.post(server.http(GA + "/calls"), content=offer,
                          headers={**AUTH, "Content-Type": "application/sdp"}, timeout=60)
    if response.status_code == 201:  # answered: hang up at once
        httpx.delete(server.http(response.headers["location"]), headers=AUTH, timeout=30)
    no_server_error(response)


@pytest.fixture(scope="module")
def token(server):
    ws = connect(server.ws(GA), additional_headers=AUTH)
    created = recv(ws)
    ws.close()
    return created["session"]["resume_token"]


@SWEEP
@given(last_seq=odd_text, resume_token=st.none() | odd_text, model=st.none() | odd_text)
def test_resume_query_strings_are_never_a_500(server, token, last_seq, resume_token, model):
    query = {"resume_token": token if resume_token is None else resume_token,
             "last_seq": last_seq, **({"model": model} if model is not None else {})}
    url = server.ws(GA) + "?" + str(httpx.QueryParams(query))
    try:
        with connect(url, additional_headers=AUTH) as ws:
            ws.close()
    except InvalidStatus as refused:
        assert refused.response.status_code < 500, refused.response.body[:300]


@pytest.fixture(scope="module")
def ga(server):
    ws = connect(server.ws(GA), additional_headers=AUTH)
    assert recv(ws)["type"] == "session.created"
    yield ws
    ws.close()


@SWEEP
@given(kind=st.sampled_from([k for k in CLIENT_EVENTS if k != "input_audio_buffer.append"]),
       fields=st.dictionaries(st.sampled_from(
           ["item", "item_id", "content_index", "audio_end_ms", "response", "session",
            "event_id", "previous_item_id"]), json_values, max_size=4))
def test_ga_events_with_any_fields_never_fail_the_session(server, ga, kind, fields):
    send(ga, {**fields, "type": kind})
    send(ga, {"type": "conversation.item.retrieve", "item_id": "item_marker"})
    try:
        while True:  # the events it caused, then the marker's answer
            event = recv(ga, 30)
            if event["type"] == "error" and "item_marker" in event["error"]["message"]:
                break
    except ConnectionClosed as closed:
        assert closed.rcvd is None or closed.rcvd.code != 1011, closed
        pytest.fail(f"the session ended on {kind}: {closed}")
