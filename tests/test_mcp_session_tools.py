"""One session's server-run calls as rules: offered beside its own tools, cancelled at
barge-in and close, a late result dropped and logged; the mcpServers file's rules."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from mlx_voicechat_plugin.runtime.events import Cancelled, ToolCall
from mlx_voicechat_plugin.runtime.options import ConversationOptions
from mlx_voicechat_plugin.runtime.tool_failures import ToolFailure
from mlx_voicechat_plugin.server.mcp.config import McpConfigError, parse_config, parse_server
from mlx_voicechat_plugin.server.mcp.events import ServerToolCall, ToolOutput
from mlx_voicechat_plugin.server.mcp.manager import McpTool, offer
from mlx_voicechat_plugin.server.mcp.session_tools import SessionTools

WEATHER = {"name": "get_weather", "description": "Weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


class FakeManager:
    """Tools as an MCP server lists them; each call waits for the test to release it."""

    def __init__(self):
        self.release = asyncio.Event()
        self.started: list[str] = []

    def tools(self) -> list[McpTool]:
        return [offer("tools", "get_weather", {"description": "Weather.",
                                               "inputSchema": WEATHER["parameters"]},
                      ("One moment.",), 5.0),
                offer("tools", "lights", {"description": "Lights \u00e0 on.",
                                          "inputSchema": {"type": "object"}}, (), 5.0)]

    async def call(self, tool: McpTool, arguments: dict) -> str:
        self.started.append(tool.name)
        await self.release.wait()
        return json.dumps({"ok": arguments})


class FakeEngine:
    def __init__(self):
        self.results: list[tuple[str, str]] = []

    async def tool_result(self, session_id: str, call_id: str, output: str) -> None:
        self.results.append((call_id, output))


class FakeSession:
    """What SessionTools uses of a session: spawn, deliver, its dialect, its engine."""

    def __init__(self):
        self.session_id, self.frames_seen, self.released = "sess_x", 0, False
        self.engine, self.sent, self.tasks = FakeEngine(), [], set()
        self.dialect = self

    def translate(self, events):
        return events

    def deliver(self, messages):
        self.sent += messages

    def spawn(self, work):
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        return task


def _tools():
    session = FakeSession()
    return session, SessionTools(session, FakeManager())


def test_server_tools_are_offered_beside_the_sessions_own_which_win_a_name():
    async def run():
        session, tools = _tools()
        options = tools.offer(ConversationOptions(tools=[WEATHER]))
        names = [t["name"] for t in options.tools]
        assert names == ["get_weather", "lights"] and options.tools[0] is WEATHER
        assert set(tools.offered) == {"lights"}  # the session's own get_weather is its own
        assert options.tools[1]["description"] == "Lights a on."  # ASCII for the checkpoint
    asyncio.run(run())


def test_a_call_runs_and_its_result_is_shown_then_given_to_the_model():
    async def run():
        session, tools = _tools()
        tools.offer(ConversationOptions())
        (event,) = tools.observe([ToolCall(3, "call_1", "get_weather", '{"city": "Oslo"}')])
        assert isinstance(event, ServerToolCall) and event.server_label == "tools"
        assert tools.runs("call_1")
        tools.manager.release.set()
        await asyncio.gather(*session.tasks)
        (shown,) = session.sent
        assert isinstance(shown, ToolOutput) and shown.failure is None
        assert session.engine.results == [("call_1", '{"ok": {"city": "Oslo"}}')]
        assert not tools.runs("call_1")
    asyncio.run(run())


def test_a_client_tool_call_is_left_to_the_client():
    async def run():
        session, tools = _tools()
        tools.offer(ConversationOptions(tools=[WEATHER]))
        (event,) = tools.observe([ToolCall(3, "call_1", "get_weather", "{}")])
        assert type(event) is ToolCall and not session.tasks
    asyncio.run(run())


def test_barge_in_cancels_the_call_and_the_model_hears_cancelled():
    async def run():
        session, tools = _tools()
        tools.offer(ConversationOptions())
        tools.observe([ToolCall(3, "call_1", "lights", "{}")])
        await asyncio.sleep(0)
        tools.observe([Cancelled(4)])
        await asyncio.gather(*session.tasks, return_exceptions=True)
        (shown,) = session.sent
        assert shown.failure == "cancelled"
        ((call_id, output),) = session.engine.results
        assert call_id == "call_1" and json.loads(output)["error"]["type"] == "cancelled"
    asyncio.run(run())


def test_a_result_after_the_stream_was_reopened_is_dropped_and_logged(caplog):
    caplog.set_level(logging.INFO)

    async def run():
        session, tools = _tools()
        tools.offer(ConversationOptions())
        tools.observe([ToolCall(3, "call_1", "lights", "{}")])
        await asyncio.sleep(0)
        tools.offer(ConversationOptions())  # session.update reopened the stream
        tools.manager.release.set()
        await asyncio.gather(*session.tasks, return_exceptions=True)
        assert not session.sent and not session.engine.results
    asyncio.run(run())
    assert "call_1" in caplog.text and "cancelled" in caplog.text


# --- the mcpServers file ------------------------------------------------------------------


def test_a_claude_desktop_config_is_read_as_it_is():
    servers = parse_config({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem",
                                             "/tmp"], "env": {"TOKEN": "t0ps3cret"}},
        "web": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer abc"}},
        "off": {"command": "x", "disabled": True}}})
    assert [(s.name, s.kind) for s in servers] == [("files", "stdio"), ("web", "http")]
    for server in servers:
        assert "t0ps3cret" not in repr(server) + server.describe()
        assert "abc" not in repr(server) + server.describe()


@pytest.mark.parametrize("spec, field", [
    ({"command": "x", "url": "http://h"}, "exactly one of"),
    ({"command": ""}, "command"),
    ({"command": "x", "args": "a b"}, "args"),
    ({"command": "x", "env": {"A": 1}}, "env"),
    ({"url": "ftp://h"}, "url"),
    ({"url": "http://h", "type": "sse"}, "sse"),
    ({"command": "x", "timeout": 0}, "timeout"),
    ({"command": "x", "toolTimeouts": {"t": -1}}, "toolTimeouts.t"),
])
def test_each_config_mistake_names_its_server_and_field(spec, field):
    with pytest.raises(McpConfigError, match=field) as caught:
        parse_server("srv", spec)
    assert "mcpServers.srv" in str(caught.value) or "sse" in field


def test_a_failure_has_one_of_the_stated_types():
    with pytest.raises(ValueError):
        ToolFailure("crashed", "x")


# --- serve --mcp --------------------------------------------------------------------------


def _serve(*argv):
    from mlx_voicechat_plugin.cli import serve

    return serve.parse(["-m", "model", *argv], "mlx-voicechat serve", False)


@pytest.mark.parametrize("text, line", [
    ('{"mcpServers": {"a": {"command": "x", "args": "y"}}}',
     "--mcp: mcpServers.a.args must be a list of strings"),
    ("{not json", "is not JSON"),
    ('{"servers": {}}', "'mcpServers' object"),
    ('{"mcpServers": {"a": {"command": "x", "disabled": true}}}', "lists no enabled server"),
])
def test_a_config_mistake_is_one_line_and_exit_code_2(tmp_path, capsys, text, line):
    config = tmp_path / "mcp.json"
    config.write_text(text)
    with pytest.raises(SystemExit) as done:
        _serve("--mcp", str(config))
    assert done.value.code == 2 and line in capsys.readouterr().err


def test_a_missing_config_names_its_path(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _serve("--mcp", str(tmp_path / "none.json"))
    assert "cannot read the MCP config" in capsys.readouterr().err


def test_serve_reads_the_config_and_the_allowed_urls(tmp_path):
    config = tmp_path / "mcp.json"
    config.write_text('{"mcpServers": {"files": {"command": "npx", "args": ["-y", "fs"]}}}')
    args = _serve("--mcp", str(config), "--mcp-allow-url", "https://mcp.example.com/*")
    assert [s.name for s in args.mcp_servers] == ["files"]
    assert args.mcp_allow_urls == ["https://mcp.example.com/*"]
    assert _serve().mcp_servers == [] and _serve().mcp_allow_urls == []


def test_a_stdio_server_starts_when_stderr_has_no_descriptor(monkeypatch, tmp_path):
    """As under a capturing test runner or an embedding host: its stderr is the process's."""
    import io

    from mcp_support import children, stdio_spec

    from mlx_voicechat_plugin.server.mcp.manager import McpManager

    monkeypatch.setattr("sys.stderr", io.StringIO())

    async def run() -> str:
        manager = McpManager([stdio_spec("tools", tmp_path / "calls.jsonl")])
        await manager.start()
        try:
            (tool,) = [t for t in manager.tools() if t.name == "get_weather"]
            return await manager.call(tool, {"city": "Oslo"})
        finally:
            await manager.close()

    assert json.loads(asyncio.run(run()))["city"] == "Oslo"
    assert not children()
