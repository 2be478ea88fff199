"""Tool calling over the realtime WebSocket: session.tools, call events, results."""

from __future__ import annotations

import json

import pytest
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    configure,
    expect_error,
    idle_connection,
    recv,
    running,
    send,
)
from tool_support import RESULT, VALID, WEATHER, Script, short_tool_prompt

from mlx_voicechat_plugin.runtime.tools import render_tool_response
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=5, idle_timeout=5)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits)))


@pytest.fixture
def ws(server, monkeypatch):
    short_tool_prompt(monkeypatch)
    yield from idle_connection(server)


def _script(server, monkeypatch, text: str) -> Script:
    voicechat = server.app.state.engine.voicechat
    return Script(voicechat.tokenizer, voicechat.config.pad_token_id, text).install(monkeypatch)


def _output(call_id: str, output: str = RESULT) -> dict:
    return {"type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": call_id, "output": output}}


def _push(ws, frames: int, offset: int = 0) -> list[dict]:
    """Push ``frames`` frames one message each; every frame's events, read up to a pong.

    The server answers in order, so the pong after a frame's append comes after
    all of that frame's events (a frame's audio delta comes with the next frame).
    """
    signal = question_signal((offset + frames) * 0.08 + 0.1)
    events = []
    for i in range(offset, offset + frames):
        send(ws, append_message(signal[i * FRAME : (i + 1) * FRAME]))
        send(ws, {"type": "session.ping"})
        while (event := recv(ws))["type"] != "session.pong":
            events.append(event)
    return events


def _of(events, kind):
    return [e for e in events if e["type"] == kind]


def test_call_is_announced_and_its_result_injected(server, ws, monkeypatch):
    script = _script(server, monkeypatch, VALID)
    configure(ws, tools=[WEATHER])
    frames = script.start + len(script.tokens)
    (done,) = _of(_push(ws, frames), "response.function_call_arguments.done")
    assert done["name"] == "get_weather" and json.loads(done["arguments"]) == {"city": "Paris"}
    assert done["call_id"].startswith("call_")

    send(ws, _output(done["call_id"]))
    tokens = len(script.tokenizer_encode(render_tool_response(RESULT)))
    later = _push(ws, tokens + 1, offset=frames)
    (injected,) = _of(later, "conversation.item.function_call_output.injected")
    assert injected["call_id"] == done["call_id"] and injected["first_frame_index"] == frames
    assert (injected["frame_index"], injected["num_tokens"]) == (frames + tokens - 1, tokens)
    assert len(_of(later, "response.audio.delta")) == tokens + 1
    # Speech resumes without a further request: the model keeps talking after the result.
    resumed = _push(ws, 8, offset=frames + tokens + 1)
    assert len(_of(resumed, "response.audio.delta")) == 8
    assert _of(resumed, "response.text.delta")


def test_invalid_call_is_an_error_event_not_a_call(server, ws, monkeypatch):
    script = _script(server, monkeypatch, VALID.replace("get_weather", "get_time"))
    configure(ws, tools=[WEATHER])
    events = _push(ws, script.start + len(script.tokens))
    assert not _of(events, "response.function_call_arguments.done")
    (error,) = _of(events, "error")
    assert error["error"]["code"] == "tool_call_invalid"
    assert error["error"]["reason"] == "unknown_tool" and "get_time" in error["error"]["raw"]


def test_function_call_output_without_tools_is_tools_not_set(ws):
    configure(ws)
    send(ws, _output("call_abc"))
    expect_error(ws, "tools_not_set")


def test_unknown_call_id_is_invalid_request(ws):
    configure(ws, tools=[WEATHER])
    send(ws, _output("call_missing"))
    assert "unknown tool call id" in expect_error(ws, "invalid_request")["error"]["message"]


def test_other_conversation_items_are_invalid_request(ws):
    configure(ws, tools=[WEATHER])
    send(ws, {"type": "conversation.item.create", "item": {"type": "message"}})
    expect_error(ws, "invalid_request")


@pytest.mark.parametrize("tools", [{"name": "x"}, [{**WEATHER, "description": "M\u00e9t\u00e9o"}]])
def test_bad_session_tools_fail_initialization(ws, tools):
    assert recv(ws)["type"] == "session.created"
    send(ws, {"type": "session.update", "session": {"tools": tools}})
    expect_error(ws, "session_initialization_failed")


def _load_example(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tool_client_runs_the_tool_and_feeds_the_result_back(server, monkeypatch, tmp_path, capsys):
    from mlx_voicechat_plugin.testing.fixtures import make_question_wav

    short_tool_prompt(monkeypatch)
    call = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    _script(server, monkeypatch, call)
    server.wait_idle()
    client = _load_example("tool_client")
    wav = make_question_wav(tmp_path / "q.wav", seconds=1.0)
    assert client.main([server.ws(), str(wav), str(tmp_path / "a.wav"), "--extra-seconds", "7"]) == 0
    out = capsys.readouterr().out
    assert '[tool] get_weather({"city": "Paris"}) -> {"city": "Paris", "condition": "sunny"' in out


def test_corrected_booking_updates_instead_of_double_booking():
    tools = _load_example("tool_client").LocalTools()
    first = json.loads(tools.run("book_table", '{"name": "Ada", "time": "19:00", "people": 2}'))
    second = json.loads(tools.run("book_table", '{"name": "ada", "time": "19:30", "people": 2}'))
    assert first["status"] == "booked" and second["status"] == "updated"
    assert len(tools.bookings) == 1 and tools.bookings["ada"]["time"] == "19:30"
