"""NVIDIA's VoiceChat protocol (NeMo-Speech.cpp's ``/v1/realtime``), spoken by our own client.

Each event and error of ``docs/api.md`` ("VoiceChat WebSocket /v1/realtime")
and ``docs/s2s/clients.md`` has its test, over a live server on the tiny
fixture (the output mapping on synthetic runtime events: test_nvidia_events.py).
"""

from __future__ import annotations

import base64
import json
import logging

import httpx
import numpy as np
import pytest
import soxr
from ga_support import API_KEY, TOOL, call_frames, scripted_call
from server_support import LiveServer, connect, recv, running, send, until_closed
from tool_support import short_tool_prompt
from websockets.exceptions import InvalidStatus

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.dialects import NVIDIA_ROOT_DIALECTS
from mlx_voicechat_plugin.server.dialects.nvidia.events import PACKET_BYTES
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal

PATH = "/nvidia/v1/realtime"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
RATE = 24_000
CHUNK = RATE * 80 // 1000  # 80 ms, as NVIDIA's client sends


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=3, idle_timeout=5)
    yield from running(LiveServer(create_app(tiny_ckpt, api_key=API_KEY, limits=limits)))


@pytest.fixture
def ws(server):
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers=AUTH) as client:
        created = recv(client)
        assert created["type"] == "session.created", created
        yield client


def pcm(seconds: float, rate: int = RATE) -> bytes:
    samples = soxr.resample(question_signal(seconds), 16_000, rate) if rate != 16_000 \
        else question_signal(seconds)
    return np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def chunks(data: bytes, rate: int = RATE) -> list[bytes]:
    step = rate * 80 // 1000 * 2
    return [data[i:i + step] for i in range(0, len(data), step)]


def append(data: bytes) -> dict:
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()}


def update(ws, **session) -> dict:
    send(ws, {"type": "session.update", "session": session})
    return recv(ws)


def fmt(rate: int) -> dict:
    return {"input": {"format": {"type": "audio/pcm", "rate": rate}},
            "output": {"format": "pcm16"}}


def close(ws) -> tuple[list[dict], dict]:
    """``session.close``: every event up to ``session.end``, and its stats."""
    send(ws, {"type": "session.close"})
    events, code = until_closed(ws)
    assert events[-1]["type"] == "session.end", [e["type"] for e in events]
    assert code == 1000
    return events, events[-1]["stats"]


def error(ws, code: str) -> dict:
    event = recv(ws)
    assert event["type"] == "error", event
    assert event["error"]["code"] == code, event
    assert set(event["error"]) >= {"type", "code", "message"}
    return event


# --- the session ------------------------------------------------------------------------


def test_session_created_advertises_24_khz_output_and_event_ids(server):
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        created = recv(ws)
        assert created["event_id"]
        assert created["session"]["audio"]["output"]["format"] == {"type": "audio/pcm",
                                                                   "rate": 24_000}
        close(ws)


def test_session_update_reports_effective_configuration(ws, monkeypatch):
    short_tool_prompt(monkeypatch)  # the update's rule, not the tool block's prefill
    tools = [{"name": "get_weather", "parameters": TOOL["parameters"],
              "ack_messages": ["One moment."]}]
    updated = update(ws, audio=fmt(16_000), instructions="Be brief.", tools=tools)
    assert updated["type"] == "session.updated"
    assert updated["session"]["audio"]["input"]["format"] == {"type": "audio/pcm",
                                                              "rate": 16_000}
    assert updated["session"]["instructions"] == "Be brief."
    assert updated["session"]["tools"] == tools
    close(ws)


def test_tools_as_json_string_in_function_form(ws, monkeypatch):
    short_tool_prompt(monkeypatch)
    tools = [{"type": "function", "function": {**{k: v for k, v in TOOL.items()
                                                  if k != "type"}}}]
    updated = update(ws, audio={"input": {"format": "pcm16"}}, tools=json.dumps(tools))
    assert updated["session"]["tools"] == tools
    close(ws)


def test_null_instructions_and_tools_as_the_reference_client_sends(ws):
    updated = update(ws, audio=fmt(24_000), instructions=None, tools=None)
    assert updated["session"]["tools"] == [] and updated["type"] == "session.updated"
    close(ws)


def test_instructions_over_the_limit(ws):
    error(update_raw(ws, instructions="x" * 32_001), "instructions_too_long")
    assert update(ws, instructions="x" * 100)["type"] == "session.updated"
    close(ws)


def update_raw(ws, **session):
    send(ws, {"type": "session.update", "session": session})
    return ws


@pytest.mark.parametrize("rate", [8_000, 96_000])
def test_input_rate_outside_16_to_48_khz_is_invalid_and_the_session_goes_on(ws, rate):
    error(update_raw(ws, audio=fmt(rate)), "invalid_event")
    assert update(ws, audio=fmt(48_000))["type"] == "session.updated"
    close(ws)


def test_output_other_than_24_khz_pcm16_is_invalid(ws):
    error(update_raw(ws, audio={"output": {"format": {"type": "audio/pcm", "rate": 16_000}}}),
          "invalid_event")
    close(ws)


def test_non_json_frame_is_invalid_and_the_socket_stays_open(ws):
    send(ws, "{")
    error(ws, "invalid_event")
    assert update(ws)["type"] == "session.updated"
    close(ws)


def test_an_error_is_logged_under_the_code_the_client_reads(ws, caplog):
    caplog.set_level(logging.INFO, logger="mlx_voicechat_plugin")
    send(ws, "{")
    error(ws, "invalid_event")
    logged = [r.getMessage() for r in caplog.records if " error " in r.getMessage()]
    assert logged and all(" error invalid_event: " in line for line in logged), logged
    close(ws)


def test_a_refused_resume_carries_nvidias_code(server):
    """An HTTP refusal at this path is in NVIDIA's shape, with NVIDIA's codes."""
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        token = recv(ws)["session"]["resume_token"]
        with pytest.raises(InvalidStatus) as refused:
            with connect(server.ws(f"{PATH}?resume_token={token}&last_seq=x"),
                         additional_headers=AUTH):
                pass
        response = refused.value.response
        assert response.status_code == 400, response.body
        body = json.loads(response.body)["error"]
        assert (body["type"], body["code"]) == ("invalid_request_error", "invalid_event"), body
        assert "last_seq" in body["message"]
        close(ws)


def test_unknown_event_is_invalid(ws):
    send(ws, {"type": "response.create"})
    error(ws, "invalid_event")
    close(ws)


def test_session_update_after_audio_is_refused_and_the_first_configuration_stays(ws):
    update(ws, audio=fmt(24_000), instructions="First.")
    ws.send(chunks(pcm(0.2))[0])
    send(ws, {"type": "session.update", "session": {"instructions": "Second."}})
    event = recv(ws)
    while event["type"] != "error":
        event = recv(ws)
    assert event["error"]["code"] == "invalid_event" and "immutable" in event["error"]["message"]
    _, stats = close(ws)
    assert stats["chunks_received"] == 1


def test_odd_byte_count_is_invalid_and_counted_as_dropped(ws):
    update(ws, audio=fmt(24_000))
    ws.send(b"\x00\x01\x02")
    error(ws, "invalid_event")
    send(ws, append(bytes(CHUNK * 2)))
    _, stats = close(ws)
    assert stats["chunks_received"] == 2 and stats["chunks_dropped"] == 1


def test_tool_result_without_tools(ws):
    update(ws)
    send(ws, {"type": "conversation.item.create",
              "item": {"type": "function_call_output", "call_id": "call_1", "output": "{}"}})
    error(ws, "tools_not_set")
    close(ws)


def test_session_timeout_without_update(server):
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        recv(ws)
        events, _ = until_closed(ws, timeout=10)
        assert events[0]["type"] == "error"
        assert events[0]["error"]["code"] == "session_timeout"


# --- audio in, audio out ------------------------------------------------------------------


def stream(ws, pieces: list[bytes], binary: bool) -> None:
    for piece in pieces:
        ws.send(piece) if binary else send(ws, append(piece))


@pytest.mark.parametrize("rate,binary", [(24_000, False), (16_000, True), (48_000, False)])
def test_audio_in_at_its_rate_out_in_80_ms_packets_then_session_end(ws, rate, binary):
    update(ws, audio=fmt(rate))
    pieces = chunks(pcm(1.0, rate), rate)
    stream(ws, pieces, binary)
    events, stats = close(ws)
    kinds = [e["type"] for e in events]
    packets = [base64.b64decode(e["delta"]) for e in events
               if e["type"] == "response.output_audio.delta"]
    assert packets and all(len(p) == PACKET_BYTES for p in packets)
    assert kinds.index("response.created") < kinds.index("response.output_item.added") \
        < kinds.index("response.content_part.added") < kinds.index("response.output_audio.delta")
    for kind in ("response.output_audio.done", "response.content_part.done",
                 "response.output_item.done", "response.done"):
        assert kind in kinds
    assert all(e["event_id"] for e in events)
    # The counters count: every chunk, every packet, one inference a frame (80 ms at 16 kHz).
    assert stats["chunks_received"] == len(pieces) and stats["chunks_dropped"] == 0
    assert stats["chunks_sent"] == len(packets)
    assert stats["triton_inferences"] == stats["inferences"] >= round(1.0 / 0.08)
    assert stats["audio_duration_received_s"] == pytest.approx(
        sum(len(p) for p in pieces) / 2 / rate, abs=1e-3)
    # ~24 kHz out for the input's time: one packet a model frame (the last padded).
    assert abs(len(packets) - stats["inferences"]) <= 1


def test_close_before_configuring_ends_with_zero_counters(ws):
    _, stats = close(ws)
    assert stats["chunks_received"] == 0 and stats["chunks_sent"] == 0


def test_audio_before_update_opens_the_default_session(ws):
    stream(ws, chunks(pcm(0.4)), binary=True)
    events, stats = close(ws)
    assert events[0]["type"] == "session.updated"
    assert stats["chunks_received"] == len(chunks(pcm(0.4)))


# --- tools ----------------------------------------------------------------------------------


def test_tool_call_and_its_result_taken_at_once(server, monkeypatch):
    script = scripted_call(server, monkeypatch)
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        recv(ws)
        update(ws, audio=fmt(16_000), tools=[TOOL])
        pieces = chunks(pcm(0.08 * (call_frames(script) + 2), 16_000), 16_000)
        stream(ws, pieces, binary=True)
        while (event := recv(ws))["type"] != "response.function_call_arguments.done":
            assert event["type"] != "error", event
        assert event["name"] == "get_weather" and json.loads(event["arguments"]) == {
            "city": "Paris"}
        send(ws, {"type": "conversation.item.create",
                  "item": {"type": "function_call_output", "status": "completed",
                           "call_id": event["call_id"], "name": "get_weather",
                           "output": '{"temp": 21}'}})
        stream(ws, chunks(bytes(16_000), 16_000), binary=True)
        events, stats = close(ws)
        assert not [e for e in events if e["type"] == "error"]
        assert stats["chunks_dropped"] == 0


# --- auth, paths, health ---------------------------------------------------------------------


def test_api_key_as_query_parameter(server):
    server.wait_idle()
    with connect(server.ws(f"{PATH}?api_key={API_KEY}")) as ws:
        assert recv(ws)["type"] == "session.created"
        close(ws)


def test_missing_key_is_refused(server):
    with pytest.raises(Exception):
        with connect(server.ws(PATH)) as ws:
            recv(ws)


def test_health_route(server):
    response = httpx.get(server.http(PATH + "/health"))
    assert response.status_code == 200 and response.json()["ready"] is True


def test_root_layout_serves_it_at_v1_realtime_and_realtime(tiny_ckpt):
    app = create_app(tiny_ckpt, dialects=NVIDIA_ROOT_DIALECTS)
    live = LiveServer(app)
    try:
        for path in ("/v1/realtime", "/realtime", PATH):
            live.wait_idle()
            with connect(live.ws(path)) as ws:
                created = recv(ws)
                assert created["session"]["audio"]["output"]["format"]["rate"] == 24_000
                close(ws)
        assert httpx.get(live.http("/v1/realtime/health")).status_code == 200
    finally:
        live.stop()


# --- /metrics ----------------------------------------------------------------------------------


def metric(server, name: str) -> float:
    text = httpx.get(server.http("/metrics"), headers=AUTH).text
    lines = [line for line in text.splitlines()
             if line.startswith(name + '{') and 'dialect="nvidia"' in line]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_metrics_count_audio_in_and_out_drops_and_frames(ws, server):
    names = ("voicechat_client_audio_received_seconds_total",
             "voicechat_client_audio_sent_seconds_total",
             "voicechat_client_audio_chunks_dropped_total",
             "voicechat_client_frames_stepped_total")
    before = {n: metric(server, n) for n in names}
    update(ws, audio=fmt(24_000))
    ws.send(b"\x00")
    error(ws, "invalid_event")
    stream(ws, chunks(pcm(0.8)), binary=True)
    _, stats = close(ws)
    moved = {n: metric(server, n) - before[n] for n in names}
    assert moved[names[0]] == pytest.approx(stats["audio_duration_received_s"], abs=1e-3)
    assert moved[names[1]] == pytest.approx(stats["chunks_sent"] * 0.08)
    assert moved[names[2]] == 1 and moved[names[3]] == stats["inferences"]
