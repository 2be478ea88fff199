"""The GA dialect's rules over a raw WebSocket: errors, formats, limits, admission.

The client libraries' own tests are test_server_ga_{openai,pipecat,livekit}.py;
these pin what they do not exercise.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import soxr
from ga_support import API_KEY, MODEL
from server_support import LiveServer, connect, recv, running, send, until_closed

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GA_PATH = f"/openai/v1/realtime?model={MODEL}"


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=5, idle_timeout=5, max_message_bytes=64 * 1024)
    yield from running(LiveServer(create_app(tiny_ckpt, api_key=API_KEY, limits=limits)))


@pytest.fixture
def ws(server):
    server.wait_idle()
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as client:
        assert recv(client)["type"] == "session.created"
        yield client


def _update(ws, **session) -> dict:
    send(ws, {"type": "session.update", "session": {"type": "realtime", **session}})
    return recv(ws)


def _append(samples_or_bytes) -> dict:
    data = samples_or_bytes if isinstance(samples_or_bytes, bytes) else \
        np.round(np.asarray(samples_or_bytes) * 32767).astype("<i2").tobytes()
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()}


def _ping(ws) -> list[dict]:
    """Everything up to the answer of a harmless delete: the server answers in order."""
    send(ws, {"type": "conversation.item.delete", "item_id": "item_ping"})
    events = []
    while (event := recv(ws))["type"] != "conversation.item.deleted":
        events.append(event)
    return events


def test_clear_is_acknowledged(ws):
    send(ws, {"type": "input_audio_buffer.clear"})
    assert recv(ws)["type"] == "input_audio_buffer.cleared"


def test_errors_have_the_ga_shape_and_echo_the_client_event_id(ws):
    send(ws, {"type": "no.such.event", "event_id": "evt_1"})
    error = recv(ws)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    assert error["event_id"] == "evt_1" and "no.such.event" in error["message"]
    assert "param" in error


def test_a_bad_session_field_is_named_and_the_session_lives(ws):
    error = _update(ws, output_modalities=["audio", "text"])["error"]
    assert "session.output_modalities" in error["message"]
    assert _update(ws, instructions="Be brief.")["type"] == "session.updated"


def test_a_bad_audio_format_is_named(ws):
    error = _update(ws, audio={"input": {"format": {"type": "audio/pcm", "rate": 16000}}})
    assert "session.audio.input.format.rate must be 24000" in error["error"]["message"]


def test_partial_updates_merge(ws):
    _update(ws, instructions="Be brief.")
    session = _update(ws, tools=[])["session"]
    assert session["instructions"] == "Be brief." and session["tools"] == []


def test_cancel_without_a_response_is_a_non_fatal_error(ws):
    send(ws, {"type": "response.cancel"})
    assert recv(ws)["error"]["code"] == "response_cancel_not_active"
    assert _ping(ws) == []


def _until(ws, kind: str) -> list[dict]:
    events = []
    while (event := recv(ws))["type"] != kind:
        events.append(event)
    return events + [event]


def test_response_create_opens_a_response_that_ends_within_its_bound(ws):
    _update(ws, max_response_seconds=0.4)
    send(ws, {"type": "response.create", "response": {"metadata": {"k": "v"}}})
    created = recv(ws)
    assert created["type"] == "response.created"
    assert created["response"]["metadata"] == {"k": "v"}
    events = _until(ws, "response.done")
    done = events[-1]["response"]
    assert done["id"] == created["response"]["id"]
    assert done["status"] in ("completed", "incomplete") and done["usage"]["input_tokens"] <= 5
    assert not [e for e in events if e["type"] == "error"]
    assert _ping(ws) == []  # the session lives on, and nothing more was owed


def test_a_response_create_while_one_is_active_gets_the_next_response(ws):
    """The model may have begun a response on its own just before a client asks:
    the request waits, and its own response opens when the active one is done."""
    _update(ws, max_response_seconds=0.4)
    send(ws, {"type": "response.create", "response": {"metadata": {"n": "1"}}})
    send(ws, {"type": "response.create", "response": {"metadata": {"n": "2"}}})
    first = _until(ws, "response.done")
    second = _until(ws, "response.done")
    created = [e for e in first + second if e["type"] == "response.created"]
    assert [e["response"]["metadata"] for e in created] == [{"n": "1"}, {"n": "2"}]
    assert [e["response"]["id"] for e in created] == \
        [first[-1]["response"]["id"], second[-1]["response"]["id"]]
    assert not [e for e in first + second if e["type"] == "error"]


def test_a_third_response_create_while_one_waits_is_a_non_fatal_error(ws):
    _update(ws, max_response_seconds=2)
    send(ws, {"type": "response.create"})
    send(ws, {"type": "response.create"})
    send(ws, {"type": "response.create", "event_id": "evt_again"})
    events = _until(ws, "error")
    assert events[-1]["error"]["code"] == "conversation_already_has_active_response", events[-1]
    assert events[-1]["error"]["event_id"] == "evt_again"
    assert _until(ws, "response.done") and _until(ws, "response.done")


def test_max_response_seconds_is_checked(ws):
    for bad in (0, "3"):  # a third failed update would close the session
        error = _update(ws, max_response_seconds=bad)["error"]
        assert "session.max_response_seconds must be within (0, 600] s" in error["message"]
    assert _update(ws, max_response_seconds=600)["type"] == "session.updated"


def test_g711_audio_goes_in_and_comes_out_as_g711(ws):
    updated = _update(ws, audio={"input": {"format": {"type": "audio/pcmu"}},
                                 "output": {"format": {"type": "audio/pcma"}}})
    assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
    ulaw = _encode_ulaw(soxr.resample(question_signal(3.0), 16_000, 8_000))
    events = []
    for start in range(0, len(ulaw), 800):  # 100 ms at 8 kHz, one byte a sample
        send(ws, _append(ulaw[start : start + 800]))
        events += _ping(ws)
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert deltas, [e["type"] for e in events]
    sizes = [len(base64.b64decode(d["delta"])) for d in deltas]
    assert abs(np.mean(sizes) - 640) < 80  # an 80 ms frame at 8 kHz, one byte a sample


def _encode_ulaw(samples) -> bytes:
    from mlx_voicechat_plugin.server.dialects.ga.audio import PCMU, AudioFormat, encode

    return encode(AudioFormat(PCMU, 8_000), samples)


def test_bad_audio_is_an_error_and_the_session_lives(ws):
    send(ws, {"type": "input_audio_buffer.append", "audio": "%%%"})
    assert "base64" in recv(ws)["error"]["message"]
    send(ws, _append(np.zeros(1920, np.float32)))
    assert [e for e in _ping(ws) if e["type"] == "error"] == []


def test_an_oversized_message_is_refused_as_in_the_other_dialect(ws):
    send(ws, {"type": "input_audio_buffer.append", "audio": "A" * (70 * 1024)})
    assert "exceeds the 65536-byte limit" in recv(ws)["error"]["message"]


def test_one_session_at_a_time_across_both_dialects(server, ws):
    send(ws, _append(np.zeros(1920, np.float32)))  # the GA session holds the engine
    _ping(ws)
    with connect(server.ws("/v1/realtime"), additional_headers=AUTH) as other:
        assert recv(other)["error"]["code"] == "server_busy"
        assert until_closed(other)[1] == 1013
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as other:
        error = recv(other)["error"]
        assert (error["type"], error["code"]) == ("server_error", "server_busy")


def test_the_model_query_is_checked_on_the_mlx_vlm_route_too(server):
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as refused:
        connect(server.ws("/v1/realtime?model=other"), additional_headers=AUTH)
    assert refused.value.response.status_code == 404


def test_a_browser_sends_the_key_as_a_subprotocol_and_gets_realtime_selected(server):
    server.wait_idle()
    offered = ["realtime", f"openai-insecure-api-key.{API_KEY}"]
    with connect(server.ws(GA_PATH), subprotocols=offered) as client:
        assert client.subprotocol == "realtime"  # the key is never echoed back
        assert recv(client)["type"] == "session.created"


def test_a_wrong_subprotocol_key_is_refused(server):
    from websockets.exceptions import InvalidStatus

    for route in (GA_PATH, "/v1/realtime"):
        with pytest.raises(InvalidStatus) as refused:
            connect(server.ws(route), subprotocols=["realtime", "openai-insecure-api-key.nope"])
        assert refused.value.response.status_code == 401


def test_models_are_listed_in_openais_shape_under_the_ga_base_url(server):
    import httpx

    listed = httpx.get(server.http("/openai/v1/models"), headers=AUTH).json()
    assert listed["object"] == "list"
    (entry,) = listed["data"]
    assert set(entry) == {"id", "object", "created", "owned_by"} and entry["id"] == MODEL
    assert httpx.get(server.http(f"/openai/v1/models/{MODEL}"), headers=AUTH).json() == entry
    missing = httpx.get(server.http("/openai/v1/models/gpt-4o"), headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.http("/openai/v1/models")).status_code == 401


def test_v1_models_has_mlx_vlms_shape(server):
    import httpx

    listed = httpx.get(server.http("/v1/models"), headers=AUTH).json()
    assert listed["object"] == "list"
    assert listed["data"][0].keys() == {"id", "object", "created", "loaded"}
    assert listed["data"][0]["id"] == MODEL and listed["data"][0]["loaded"] is True


def test_the_subprotocol_key_is_compared_in_constant_time_and_never_logged(server, monkeypatch,
                                                                            caplog):
    import logging
    from types import SimpleNamespace

    from mlx_voicechat_plugin.server.routes import access as app_module

    calls = []
    real = app_module.hmac.compare_digest
    monkeypatch.setattr(app_module.hmac, "compare_digest",
                        lambda a, b: calls.append((a, b)) or real(a, b))
    upgrade = SimpleNamespace(headers={}, scope={"subprotocols": [
        "realtime", "openai-insecure-api-key.guess"]})
    assert app_module.websocket_auth(upgrade, "secret") == (False, "realtime")
    assert calls == [(b"guess", b"secret")]
    upgrade.scope["subprotocols"] = ["openai-insecure-api-key.secret"]
    assert app_module.websocket_auth(upgrade, "secret") == (True, None)  # nothing to select

    caplog.set_level(logging.DEBUG)
    server.wait_idle()
    with connect(server.ws(GA_PATH), subprotocols=["realtime",
                                                   f"openai-insecure-api-key.{API_KEY}"]) as ws:
        recv(ws)
    text = "\n".join(r.getMessage() for r in caplog.records
                     if r.name.startswith(("mlx_voicechat_plugin", "uvicorn", "fastapi")))
    assert "connected" in text and API_KEY not in text


def test_a_full_stream_ends_the_connection_normally(ws):
    """The session's max_streaming_seconds reached by the client's audio: its error,
    then close 1000 (the runtime's ContextLimit, carried as its type)."""
    assert _update(ws, max_streaming_seconds=0.16)["type"] == "session.updated"
    send(ws, _append(np.zeros(24_000 // 2, np.float32)))  # 0.5 s: past the two frames
    events, code = until_closed(ws)
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert code == 1000 and errors and "max_streaming_seconds" in errors[0]["message"]


def test_a_stream_filled_by_the_servers_silence_ends_normally(ws):
    """The same bound reached by the silence run for an owed response."""
    assert _update(ws, max_streaming_seconds=0.16,
                   audio={"input": {"turn_detection": None}})["type"] == "session.updated"
    send(ws, {"type": "input_audio_buffer.commit"})
    events, code = until_closed(ws)
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert code == 1000 and errors and "max_streaming_seconds" in errors[0]["message"]
