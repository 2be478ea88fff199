"""The operator's MCP servers (``serve --mcp``) as every session's tools, over real sockets.

A real MCP server built with the SDK runs as a stdio child of the server; the
model's function channel is scripted (tool_support.Script). The mlx-vlm dialect's
client sees the call, its output and its injection; each failure is one typed
failure the model hears and the client sees, and the session goes on.
"""

from __future__ import annotations

import json
import time

import pytest
from mcp_support import SECRET, calls, children, open_fds, stdio_spec
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    configure,
    connect,
    recv,
    running,
    send,
)
from tool_support import VALID, Script, short_tool_prompt

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    return tmp_path_factory.mktemp("mcp") / "calls.jsonl"


@pytest.fixture(scope="module")
def server(tiny_ckpt, log):
    limits = ServerLimits(update_timeout=20, idle_timeout=30, max_sessions=2)
    app = create_app(tiny_ckpt, limits=limits, mcp_servers=[stdio_spec("tools", log)])
    live = LiveServer(app)
    app.state.mcp.connections["tools"].backoff = (0.2, 1.0)
    yield from running(live)
    assert not children(), "a stdio MCP server outlived the app"


@pytest.fixture
def ws(server, monkeypatch):
    short_tool_prompt(monkeypatch)
    server.wait_idle()
    connection = server.app.state.mcp.connections["tools"]
    wait_connected(connection)
    with connect(server.ws()) as client:
        yield client


def wait_connected(connection, seconds: float = 30) -> None:
    """Wait (polling from the test's thread) until the MCP server is connected."""
    deadline = time.monotonic() + seconds
    while not connection.connected:
        assert time.monotonic() < deadline, connection.error
        time.sleep(0.05)


def _tasks(server) -> int:
    """The tasks on the server's event loop now."""
    import asyncio

    async def count() -> int:
        return len(asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), server.app.state.drain.loop).result(10)


def _call(name: str, arguments: dict) -> str:
    return f'<TOOLCALL>[{json.dumps({"name": name, "arguments": arguments})}]</TOOLCALL>'


def _script(server, monkeypatch, text: str) -> Script:
    voicechat = server.app.state.engine.voicechat
    return Script(voicechat.tokenizer, voicechat.config.pad_token_id, text).install(monkeypatch)


class Pusher:
    """Pushes frames, then a ping, and reads their events up to its pong; keeps them."""

    def __init__(self, ws):
        self.ws, self.frame, self.events = ws, 0, []
        self.signal = question_signal(60.0)

    def push(self, frames: int) -> list[dict]:
        new = []
        for _ in range(frames):
            chunk = self.signal[self.frame * FRAME:(self.frame + 1) * FRAME]
            self.frame += 1
            send(self.ws, append_message(chunk))
        send(self.ws, {"type": "session.ping"})
        while (event := recv(self.ws, 30))["type"] != "session.pong":
            new.append(event)
        self.events += new
        return new

    def until(self, kind: str, most: int = 100) -> dict:
        """Push frames (8 at a time) until an event of ``kind`` came (the call runs
        meanwhile)."""
        for _ in range(most):
            found = [e for e in self.events if e["type"] == kind]
            if found:
                return found[0]
            self.push(8)
        raise AssertionError(f"no {kind} within {most} frames")


def _of(events, kind):
    return [e for e in events if e["type"] == kind]


def test_mcp_call_runs_on_the_server_and_its_result_reaches_the_model(server, ws, monkeypatch,
                                                                        log, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    script = _script(server, monkeypatch, VALID)
    configure(ws)
    pusher = Pusher(ws)
    pusher.push(script.start + len(script.tokens))
    call = pusher.until("response.function_call_arguments.done")
    assert call["name"] == "get_weather" and call["server_label"] == "tools"
    output = pusher.until("conversation.item.function_call_output")
    assert output["call_id"] == call["call_id"] and "error" not in output
    assert json.loads(output["output"]) == {"city": "Paris", "temp": 21}
    injected = pusher.until("conversation.item.function_call_output.injected")
    assert injected["call_id"] == call["call_id"]
    assert calls(log)[-1] == {"name": "get_weather", "arguments": {"city": "Paris"},
                              "pid": calls(log)[-1]["pid"]}
    # The result's tokens reached the function channel (the model's input).
    forced = [t for t in script.forced if t is not None]
    assert len(forced) == injected["num_tokens"]
    assert _of(pusher.push(3), "response.audio.delta")
    assert SECRET not in json.dumps(pusher.events) and SECRET not in caplog.text


def _second_session_calls_the_same_server(server, monkeypatch, log) -> None:
    """A new session's call of the same MCP server (restarted if it must) succeeds."""
    server.wait_idle()
    wait_connected(server.app.state.mcp.connections["tools"])
    script = _script(server, monkeypatch, _call("get_weather", {"city": "Oslo"}))
    with connect(server.ws()) as ws:
        configure(ws)
        pusher = Pusher(ws)
        pusher.push(script.start + len(script.tokens))
        output = pusher.until("conversation.item.function_call_output")
        assert "error" not in output and json.loads(output["output"])["city"] == "Oslo"
    assert calls(log)[-1]["arguments"] == {"city": "Oslo"}


@pytest.mark.parametrize("name, arguments, failure", [
    ("slow", {"seconds": 600}, "timeout"),  # its own timeout: 2 s (toolTimeouts)
    ("crash", {}, "server_error"),  # the child exits: restarted with backoff
    ("garbage", {}, "bad_response"),  # bytes that are not MCP on its stdout
    ("huge", {}, "too_large"),  # 1 MiB, far past the 4 KiB result bound
    ("fail", {}, "tool_error"),  # the tool reports an error
])
def test_each_failure_is_one_typed_failure_and_the_session_goes_on(
        server, ws, monkeypatch, log, name, arguments, failure):
    fds, tasks = open_fds(), _tasks(server)
    script = _script(server, monkeypatch, _call(name, arguments))
    configure(ws)
    pusher = Pusher(ws)
    pusher.push(script.start + len(script.tokens))
    call = pusher.until("response.function_call_arguments.done")
    output = pusher.until("conversation.item.function_call_output")
    assert output["call_id"] == call["call_id"] and output["error"]["type"] == failure
    assert json.loads(output["output"]) == {"error": output["error"]}  # what the model hears
    (error,) = [e for e in pusher.events if e["type"] == "error"]
    assert error["error"]["code"] == "tool_call_failed"
    assert (error["error"]["reason"], error["error"]["call_id"]) == (failure, call["call_id"])
    injected = pusher.until("conversation.item.function_call_output.injected")
    assert injected["call_id"] == call["call_id"]
    assert _of(pusher.push(3), "response.audio.delta")  # the session answers after it
    assert calls(log)[-1]["name"] == name
    ws.close()
    _second_session_calls_the_same_server(server, monkeypatch, log)
    assert len(children()) == 1  # the one server child (a crashed one was reaped)
    assert open_fds() <= fds + 2  # its pipes and sockets closed (the test's own client too)
    deadline = time.monotonic() + 10
    while _tasks(server) > tasks:  # no task left behind (the first client's are gone too)
        assert time.monotonic() < deadline, f"{_tasks(server)} tasks, {tasks} before"
        time.sleep(0.05)


@pytest.mark.parametrize("text, reason", [
    (_call("get_time", {}), "unknown_tool"),
    (_call("get_weather", {"city": 3}), "schema"),
    (_call("slow", {}), "schema"),  # a required argument missing
])
def test_a_call_the_schema_refuses_never_reaches_the_server(server, ws, monkeypatch, log,
                                                             text, reason):
    before = len(calls(log))
    script = _script(server, monkeypatch, text)
    configure(ws)
    pusher = Pusher(ws)
    pusher.push(script.start + len(script.tokens))
    (error,) = [e for e in pusher.events if e["type"] == "error"]
    assert error["error"]["code"] == "tool_call_invalid" and error["error"]["reason"] == reason
    assert not _of(pusher.events, "response.function_call_arguments.done")
    assert _of(pusher.push(3), "response.audio.delta")
    assert len(calls(log)) == before


def test_a_client_cannot_answer_a_call_the_server_runs(server, ws, monkeypatch, log):
    script = _script(server, monkeypatch, _call("slow", {"seconds": 1.5}))
    configure(ws)
    pusher = Pusher(ws)
    pusher.push(script.start + len(script.tokens))
    call = pusher.until("response.function_call_arguments.done")
    send(ws, {"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": call["call_id"], "output": "{}"}})
    pusher.push(1)
    errors = [e for e in pusher.events if e["type"] == "error"]
    assert errors and "run by the server" in errors[0]["error"]["message"]
    output = pusher.until("conversation.item.function_call_output")
    assert output["output"] == '"done"' or output["output"] == "done"


def test_a_call_in_flight_is_cancelled_when_the_session_closes(server, ws, monkeypatch, log):
    script = _script(server, monkeypatch, _call("slow", {"seconds": 1.8}))
    configure(ws)
    pusher = Pusher(ws)
    pusher.push(script.start + len(script.tokens))
    pusher.until("response.function_call_arguments.done")
    ws.close()  # while the call runs
    _second_session_calls_the_same_server(server, monkeypatch, log)


def test_a_session_cannot_see_another_sessions_calls_or_results(server, ws, monkeypatch, log):
    with connect(server.ws()) as other:
        configure(other)  # open beside the first, on the same MCP server
        script = _script(server, monkeypatch, VALID)
        configure(ws)
        pusher = Pusher(ws)
        pusher.push(script.start + len(script.tokens))
        call = pusher.until("response.function_call_arguments.done")
        pusher.until("conversation.item.function_call_output")
        send(other, {"type": "session.ping"})
        seen = []
        while (event := recv(other, 30))["type"] != "session.pong":
            seen.append(event)
        assert call["call_id"] not in json.dumps(seen)
        assert not [e for e in seen if "function_call" in e["type"]]


def test_the_env_secret_reaches_the_child_and_nothing_else(server, ws, monkeypatch, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    script = _script(server, monkeypatch, _call("has_secret", {}))
    configure(ws)
    pusher = Pusher(ws)
    pusher.push(script.start + len(script.tokens))
    assert pusher.until("conversation.item.function_call_output")["output"] == "true"
    assert SECRET not in json.dumps(pusher.events) and SECRET not in caplog.text
