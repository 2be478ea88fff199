"""NVIDIA's VoiceChat protocol (NeMo-Speech.cpp's ``/v1/realtime``), spoken by our own client.

Each event and error of ``docs/api.md`` ("VoiceChat WebSocket /v1/realtime")
and ``docs/s2s/clients.md`` has its test: over a live server on the tiny
fixture, and the output mapping on synthetic runtime events.
"""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import soxr
from ga_support import API_KEY, TOOL, call_frames, scripted_call
from server_support import LiveServer, connect, recv, running, send, until_closed

from mlx_voicechat_plugin.runtime.events import (
    AssistantTextDelta, Audio, ToolCall, TurnEnded, UserTranscriptDelta,
)
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.dialects import NVIDIA_ROOT_DIALECTS
from mlx_voicechat_plugin.server.dialects.nvidia_events import (
    PACKET_BYTES, USER_PAUSE_FRAMES, Conversation, Counters,
)
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.transport.websocket import serialize
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


def test_session_update_reports_effective_configuration(ws):
    tools = [{"name": "get_weather", "parameters": TOOL["parameters"],
              "ack_messages": ["One moment."]}]
    updated = update(ws, audio=fmt(16_000), instructions="Be brief.", tools=tools)
    assert updated["type"] == "session.updated"
    assert updated["session"]["audio"]["input"]["format"] == {"type": "audio/pcm",
                                                              "rate": 16_000}
    assert updated["session"]["instructions"] == "Be brief."
    assert updated["session"]["tools"] == tools
    close(ws)


def test_tools_as_json_string_in_function_form(ws):
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


# --- the output mapping, on synthetic frames ---------------------------------------------------


def frame(index: int, **extra) -> list:
    events = [Audio(index, np.zeros(1764, np.float32), 22_050, np.zeros(31, np.int32))]
    if "user" in extra:
        events.append(UserTranscriptDelta(index, extra["user"], extra["user"]))
    if "text" in extra:
        events.append(AssistantTextDelta(index, 7, extra["text"], extra["text"]))
    if extra.get("eos"):
        events.append(TurnEnded(index))
    if extra.get("call"):
        events.append(ToolCall(index, "call_" + "ab" * 16, "get_weather", '{"city": "Paris"}'))
    return events


def kinds(messages) -> list[str]:
    return [json.loads(serialize(m))["type"] for m in messages]


def test_user_turn_events():
    book = Conversation(22_050, Counters())
    out = book.translate(frame(0, user="hel")) + book.translate(frame(1, user="lo"))
    assert [k for k in kinds(out) if not k.startswith("response.")] == [
        "input_audio_buffer.speech_started",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.delta"]
    quiet = [m for i in range(USER_PAUSE_FRAMES) for m in book.translate(frame(2 + i))]
    assert [k for k in kinds(quiet) if not k.startswith("response.")] == [
        "conversation.item.input_audio_transcription.completed",
        "input_audio_buffer.speech_stopped"]
    completed = [json.loads(serialize(m)) for m in quiet
                 if kinds([m])[0].endswith("completed")]
    assert completed[0]["transcript"] == "hello"


def test_assistant_transcript_per_turn():
    book = Conversation(22_050, Counters())
    out = book.translate(frame(0, text="Hi")) + book.translate(frame(1, text=" there", eos=True))
    out += book.translate(frame(2, text="Again", eos=True))
    done = [json.loads(serialize(m)) for m in out
            if kinds([m])[0] == "response.output_audio_transcript.done"]
    assert [d["transcript"] for d in done] == ["Hi there", "Again"]
    assert kinds(out).count("response.output_audio_transcript.delta") == 3


def test_assistant_speech_ends_the_user_turn():
    book = Conversation(22_050, Counters())
    book.translate(frame(0, user="hi"))
    out = kinds(book.translate(frame(1, text="Hello")))
    assert out.index("input_audio_buffer.speech_stopped") < out.index(
        "response.output_audio_transcript.delta")


def test_tool_call_event():
    book = Conversation(22_050, Counters())
    out = [json.loads(serialize(m)) for m in book.translate(frame(0, call=True))]
    call = [e for e in out if e["type"] == "response.function_call_arguments.done"][0]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_")


def test_packets_are_exactly_80_ms_and_the_tail_is_padded():
    counters = Counters()
    book = Conversation(22_050, counters)
    out = [m for i in range(10) for m in book.translate(frame(i))] + book.finish()
    packets = [m for m in out if kinds([m])[0] == "response.output_audio.delta"]
    assert all(len(p.data) == PACKET_BYTES for p in packets)
    assert abs(len(packets) - 10) <= 1 and counters.chunks_sent == len(packets)
    assert counters.inferences == 10
    assert kinds(out)[-1] == "response.done"
