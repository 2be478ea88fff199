"""A call the client runs: its timeout and its result bound, in each dialect, through
real sockets. The model hears the typed failure; the client sees its dialect's failure;
a late output is refused naming the call; the session answers after each."""

from __future__ import annotations

import base64
import json
import logging

import numpy as np
import pytest
import soxr
from ga_schema import check
from ga_support import API_KEY, MODEL, TOOL, call_frames, scripted_call
from server_support import LiveServer, connect, recv, running, send, until_closed
from tool_support import WEATHER

from mlx_voicechat_plugin.runtime.tool_failures import DEFAULT_MAX_RESULT_BYTES
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT_S = 2.0
GA_PATH = f"/openai/v1/realtime?model={MODEL}"
GA_SESSION = {"type": "realtime", "output_modalities": ["audio"], "tools": [TOOL],
              "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}},
                        "output": {"format": {"type": "audio/pcm", "rate": 24000}}}}
OVERSIZE = json.dumps({"text": "x" * DEFAULT_MAX_RESULT_BYTES})


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=10, idle_timeout=30, tool_timeout=TIMEOUT_S)
    yield from running(LiveServer(create_app(tiny_ckpt, api_key=API_KEY, limits=limits)))


def _pcm(frames: int, rate: int) -> bytes:
    samples = question_signal(frames * 0.08 + 0.3)
    if rate != 16_000:
        samples = soxr.resample(samples, 16_000, rate)
    return np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def _appends(frames: int, rate: int) -> list[dict]:
    data, step = _pcm(frames, rate), rate * 80 // 1000 * 2
    return [{"type": "input_audio_buffer.append",
             "audio": base64.b64encode(data[i:i + step]).decode()}
            for i in range(0, len(data), step)]


def _output(call_id: str, output: str = '{"temp": 21}') -> dict:
    return {"type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": call_id, "output": output}}


def _until(ws, kind: str, events: list[dict], strict: bool = False, timeout: float = 30) -> dict:
    while True:
        event = recv(ws, timeout)
        if strict:
            check(event)  # against the openai package's RealtimeServerEvent
        events.append(event)
        if event["type"] == kind:
            return event


def _errors(events: list[dict]) -> list[dict]:
    return [e["error"] for e in events if e["type"] == "error"]


# --- GA ----------------------------------------------------------------------------------


def _ga_call(server, monkeypatch, ws, events: list[dict]) -> dict:
    script = scripted_call(server, monkeypatch)
    _until(ws, "session.created", events, strict=True)
    send(ws, {"type": "session.update", "session": GA_SESSION})
    _until(ws, "session.updated", events, strict=True)
    for message in _appends(call_frames(script) + 2, 24_000):
        send(ws, message)
    return _until(ws, "response.function_call_arguments.done", events, strict=True)


def _ga_answers(ws, events: list[dict]) -> None:
    send(ws, {"type": "input_audio_buffer.clear"})
    _until(ws, "input_audio_buffer.cleared", events, strict=True)


def test_ga_timeout_is_a_tool_call_failed_error_and_a_late_output_is_refused(
        server, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as ws:
        call = _ga_call(server, monkeypatch, ws, events)
        failed = _until(ws, "error", events, strict=True, timeout=TIMEOUT_S + 30)["error"]
        assert failed["code"] == "tool_call_failed" and failed["param"] == call["call_id"]
        assert failed["message"].startswith("timeout: ")
        send(ws, _output(call["call_id"]))  # too late
        late = _until(ws, "error", events, strict=True)["error"]
        assert late["code"] == "invalid_request" and call["call_id"] in late["message"]
        assert "timed out" in late["message"]
        _ga_answers(ws, events)
    assert "late output of call" in caplog.text


def test_ga_oversize_output_is_refused_and_the_model_hears_too_large(server, monkeypatch):
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as ws:
        call = _ga_call(server, monkeypatch, ws, events)
        send(ws, _output(call["call_id"], OVERSIZE))
        refused = _until(ws, "error", events, strict=True)["error"]
        assert refused["code"] == "tool_call_failed" and "too_large" in refused["message"]
        assert str(DEFAULT_MAX_RESULT_BYTES) in refused["message"]
        _ga_answers(ws, events)
    # Answered (with the failure): no timeout follows.
    assert not [e for e in _errors(events) if e["message"].startswith("timeout")]


# --- mlx-vlm -----------------------------------------------------------------------------


def _vlm_call(server, monkeypatch, ws, events: list[dict]) -> dict:
    script = scripted_call(server, monkeypatch)
    assert recv(ws)["type"] == "session.created"
    send(ws, {"type": "session.update", "session": {"tools": [WEATHER]}})
    _until(ws, "session.updated", events)
    for message in _appends(call_frames(script) + 2, 16_000):
        send(ws, message)
    return _until(ws, "response.function_call_arguments.done", events)


def test_vlm_timeout_is_the_failed_output_and_a_late_output_is_refused(server, monkeypatch):
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws(), additional_headers=AUTH) as ws:
        call = _vlm_call(server, monkeypatch, ws, events)
        output = _until(ws, "conversation.item.function_call_output", events,
                        timeout=TIMEOUT_S + 30)
        assert output["call_id"] == call["call_id"] and output["error"]["type"] == "timeout"
        assert json.loads(output["output"])["error"]["type"] == "timeout"  # the model's
        failed = _until(ws, "error", events)["error"]
        assert (failed["code"], failed["reason"]) == ("tool_call_failed", "timeout")
        send(ws, _output(call["call_id"]))
        late = _until(ws, "error", events)["error"]
        assert late["code"] == "invalid_request" and "timed out" in late["message"]
        send(ws, {"type": "session.ping"})
        _until(ws, "session.pong", events)


def test_vlm_oversize_output_is_refused(server, monkeypatch):
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws(), additional_headers=AUTH) as ws:
        call = _vlm_call(server, monkeypatch, ws, events)
        send(ws, _output(call["call_id"], OVERSIZE))
        refused = _until(ws, "error", events)["error"]
        assert refused["code"] == "tool_call_failed" and "too_large" in refused["message"]
        send(ws, {"type": "session.ping"})
        _until(ws, "session.pong", events)


# --- NVIDIA ------------------------------------------------------------------------------


def _nvidia_call(server, monkeypatch, ws, events: list[dict]) -> dict:
    script = scripted_call(server, monkeypatch)
    assert recv(ws)["type"] == "session.created"
    send(ws, {"type": "session.update", "session": {
        "tools": [TOOL], "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16_000}},
                                   "output": {"format": "pcm16"}}}})
    _until(ws, "session.updated", events)
    for message in _appends(call_frames(script) + 2, 16_000):
        send(ws, message)
    return _until(ws, "response.function_call_arguments.done", events)


def _nvidia_answers(ws) -> None:
    send(ws, {"type": "session.close"})
    closing, _ = until_closed(ws)
    assert closing[-1]["type"] == "session.end"


def test_nvidia_timeout_is_a_tool_error_and_a_late_output_is_refused(server, monkeypatch):
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws("/nvidia/v1/realtime"), additional_headers=AUTH) as ws:
        call = _nvidia_call(server, monkeypatch, ws, events)
        failed = _until(ws, "error", events, timeout=TIMEOUT_S + 30)["error"]
        assert (failed["call_id"], failed["reason"]) == (call["call_id"], "timeout")
        output = [e for e in events if e["type"] == "conversation.item.function_call_output"]
        assert json.loads(output[-1]["output"])["error"]["type"] == "timeout"
        send(ws, _output(call["call_id"]))
        late = _until(ws, "error", events)["error"]
        assert "timed out" in late["message"]
        _nvidia_answers(ws)


def test_nvidia_oversize_output_is_refused(server, monkeypatch):
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws("/nvidia/v1/realtime"), additional_headers=AUTH) as ws:
        call = _nvidia_call(server, monkeypatch, ws, events)
        send(ws, _output(call["call_id"], OVERSIZE))
        refused = _until(ws, "error", events)["error"]
        assert "too_large" in refused["message"]
        _nvidia_answers(ws)


def test_tool_timeout_must_be_positive():
    with pytest.raises(ValueError, match="tool_timeout"):
        ServerLimits(tool_timeout=0)


def test_serve_takes_tool_timeout_and_states_its_default(capsys):
    from mlx_voicechat_plugin.cli.serve import build_parser, parse
    from mlx_voicechat_plugin.runtime.tool_failures import DEFAULT_TOOL_TIMEOUT

    assert parse(["--model", "m", "--tool-timeout", "7.5"], "serve",
                 False).limits.tool_timeout == 7.5
    assert parse(["--model", "m"], "serve", False).limits.tool_timeout == DEFAULT_TOOL_TIMEOUT
    assert f"default: {DEFAULT_TOOL_TIMEOUT}" in build_parser().format_help().replace("\n", " ")
    with pytest.raises(SystemExit) as exited:
        parse(["--model", "m", "--tool-timeout", "0"], "serve", False)
    assert exited.value.code == 2 and "tool_timeout" in capsys.readouterr().err
