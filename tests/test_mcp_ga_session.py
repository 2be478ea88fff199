"""GA's per-session ``{"type": "mcp"}`` tool: listed, called, approved or denied, every event
strictly valid; only URLs the operator allows are reached, its headers never shown."""

from __future__ import annotations

import asyncio
import base64
import json
import logging

import pytest
from ga_support import API_KEY, MODEL, call_frames, question_wav_24k, scripted_call, wav_chunks
from mcp_support import SECRET, calls, ga_until, mcp_log, mcp_server  # noqa: F401 (fixtures)
from server_support import LiveServer, connect, running, send
from tool_support import short_tool_prompt

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.mcp.session_servers import UrlPolicy, UrlRefused

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GA_PATH = f"/openai/v1/realtime?model={MODEL}"
AUDIO = {"input": {"format": {"type": "audio/pcm", "rate": 24000}},
         "output": {"format": {"type": "audio/pcm", "rate": 24000}}}


@pytest.fixture(scope="module")
def server(tiny_ckpt, mcp_server):
    limits = ServerLimits(update_timeout=30, idle_timeout=30)
    app = create_app(tiny_ckpt, api_key=API_KEY, limits=limits,
                     mcp_allow_urls=[f"http://127.0.0.1:{mcp_server.port}/*"])
    yield from running(LiveServer(app))


@pytest.fixture(autouse=True)
def _short_tool_prompt(monkeypatch):
    """Sessions prefill a short stand-in for their tool block from their first update on
    (its text is pinned in test_tools.py)."""
    short_tool_prompt(monkeypatch)


def _tool(url: str, **extra) -> dict:
    return {"type": "mcp", "server_label": "web", "server_url": url,
            "headers": {"Authorization": f"Bearer {SECRET}"}, **extra}


_until = ga_until


def _session(server, tools: list[dict], events: list[dict]):
    ws = connect(server.ws(GA_PATH), additional_headers=AUTH)
    _until(ws, "session.created", events)
    send(ws, {"type": "session.update", "session": {"type": "realtime", "tools": tools,
                                                    "audio": AUDIO}})
    return ws


def _speak(ws, server, monkeypatch, tmp_path) -> None:
    script = scripted_call(server, monkeypatch)
    wav = question_wav_24k(tmp_path / "q.wav", call_frames(script) * 0.08 + 0.5)
    for chunk in wav_chunks(wav):
        send(ws, {"type": "input_audio_buffer.append",
                  "audio": base64.b64encode(chunk).decode()})


def test_a_session_mcp_server_is_listed_and_called(server, mcp_server, mcp_log, monkeypatch,
                                                   tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    server.wait_idle()
    events: list[dict] = []
    ws = _session(server, [_tool(mcp_server.url, require_approval="never",
                                 allowed_tools=["get_weather", "slow"])], events)
    with ws:
        _until(ws, "mcp_list_tools.in_progress", events)
        _until(ws, "mcp_list_tools.completed", events)
        listed = _until(ws, "conversation.item.done", events)["item"]
        assert listed["type"] == "mcp_list_tools" and listed["server_label"] == "web"
        assert sorted(t["name"] for t in listed["tools"]) == ["get_weather", "slow"]
        updated = _until(ws, "session.updated", events)
        assert updated["session"]["tools"][0]["type"] == "mcp"
        assert "headers" not in updated["session"]["tools"][0]
        _speak(ws, server, monkeypatch, tmp_path)
        completed = _until(ws, "response.mcp_call.completed", events)
        item = _until(ws, "conversation.item.done", events)["item"]
        assert item["id"] == completed["item_id"] and item["server_label"] == "web"
        assert json.loads(item["output"])["temp"] == 21
    assert calls(mcp_log)[-1]["arguments"] == {"city": "Paris"}
    assert not [e for e in events if e["type"] in ("error", "mcp_approval_request")]
    assert any(h.get("authorization") == f"Bearer {SECRET}" for h in mcp_server.headers)
    assert SECRET not in json.dumps(events) and SECRET not in caplog.text


@pytest.mark.parametrize("approval, asked, approve", [
    ("always", True, True),
    ("always", True, False),
    ("never", False, None),
    ({"never": {"tool_names": ["get_weather"]}}, False, None),  # per tool: not this one
    ({"always": {"tool_names": ["get_weather"]}, "never": {"tool_names": ["slow"]}}, True,
     True),
    ({"always": {"tool_names": ["get_weather"]}}, True, False),
])
def test_require_approval_is_honoured(server, mcp_server, mcp_log, monkeypatch, tmp_path,
                                      approval, asked, approve):
    server.wait_idle()
    before = len(calls(mcp_log))
    events: list[dict] = []
    ws = _session(server, [_tool(mcp_server.url, require_approval=approval)], events)
    with ws:
        _until(ws, "session.updated", events)
        _speak(ws, server, monkeypatch, tmp_path)
        if asked:
            request = _until(ws, "conversation.item.added", events)["item"]
            while request["type"] != "mcp_approval_request":
                request = _until(ws, "conversation.item.added", events)["item"]
            assert (request["name"], request["server_label"]) == ("get_weather", "web")
            send(ws, {"type": "conversation.item.create", "item": {
                "type": "mcp_approval_response", "approval_request_id": request["id"],
                "approve": approve}})
        kind = "response.mcp_call.completed" if approve is not False \
            else "response.mcp_call.failed"
        _until(ws, kind, events)
        item = _until(ws, "conversation.item.done", events)["item"]
        while item["type"] != "mcp_call":
            item = _until(ws, "conversation.item.done", events)["item"]
    requests = [e for e in events if e["type"] == "conversation.item.added"
                and e["item"]["type"] == "mcp_approval_request"]
    assert bool(requests) == asked
    added = [e["item"] for e in events if e["type"] == "conversation.item.added"
             and e["item"]["type"] in ("mcp_approval_request", "mcp_call")]
    if asked:  # the request first, then the call naming it, as OpenAI's
        assert [i["type"] for i in added] == ["mcp_approval_request", "mcp_call"]
        assert added[1]["approval_request_id"] == added[0]["id"] == item["approval_request_id"]
    else:
        assert [i["type"] for i in added] == ["mcp_call"]
        assert "approval_request_id" not in item
    if approve is False:  # denied: not run, and the model hears so
        assert item["error"]["message"].startswith("denied: ")
        assert len(calls(mcp_log)) == before
    else:
        assert json.loads(item["output"])["temp"] == 21
        assert len(calls(mcp_log)) == before + 1


def test_an_approval_nobody_asked_for_is_invalid(server, mcp_server):
    server.wait_idle()
    events: list[dict] = []
    with _session(server, [_tool(mcp_server.url)], events) as ws:
        _until(ws, "session.updated", events)
        send(ws, {"type": "conversation.item.create", "item": {
            "type": "mcp_approval_response", "approval_request_id": "mcpr_nope",
            "approve": True}})
        error = _until(ws, "error", events)["error"]
        assert error["code"] == "invalid_request" and "mcpr_nope" in error["message"]


@pytest.mark.parametrize("url", [
    "http://127.0.0.2:9/mcp",  # loopback, no pattern
    "http://10.0.0.1/mcp",  # a private range
    "http://169.254.169.254/latest/meta-data",  # link-local (cloud metadata)
    "https://example.com/mcp",  # not allowed by the operator
])
def test_a_session_cannot_reach_a_url_the_operator_did_not_allow(server, url, mcp_log):
    server.wait_idle()
    events: list[dict] = []
    before = len(calls(mcp_log))
    with _session(server, [_tool(url, require_approval="never")], events) as ws:
        _until(ws, "mcp_list_tools.failed", events)
        error = _until(ws, "error", events)["error"]
        assert error["code"] == "mcp_list_tools_failed" and "not allowed" in error["message"]
        _until(ws, "session.updated", events)  # the session goes on, without those tools
    assert SECRET not in json.dumps(events) and len(calls(mcp_log)) == before


def test_without_allowed_urls_no_session_names_a_server(tiny_ckpt):
    app = create_app(tiny_ckpt, api_key=API_KEY,
                     limits=ServerLimits(update_timeout=10, idle_timeout=10))
    live = LiveServer(app)
    try:
        events: list[dict] = []
        with _session(live, [_tool("http://127.0.0.1:1/mcp")], events) as ws:
            _until(ws, "mcp_list_tools.failed", events)
            assert "--mcp-allow-url" in _until(ws, "error", events)["error"]["message"]
            _until(ws, "session.updated", events)
    finally:
        live.stop()


# --- the policy, as rules ---------------------------------------------------------------


def _check(patterns, url):
    asyncio.run(UrlPolicy(patterns).check(url))


@pytest.mark.parametrize("patterns, url", [
    ([], "https://example.com/mcp"),  # none by default
    (["https://*/mcp"], "https://127.0.0.1/mcp"),  # a wildcard host never means loopback
    (["http://*"], "http://10.1.2.3/x"),
    (["http://*"], "http://[::1]:8000/mcp"),
    (["http://*"], "http://169.254.169.254/"),
    (["https://mcp.example.com/*"], "https://mcp.example.com.evil.net/x"),
    (["https://*"], "https://user:pw@mcp.example.com/x"),  # credentials in the URL
    (["*"], "file:///etc/passwd"),
])
def test_the_url_policy_refuses(patterns, url):
    with pytest.raises(UrlRefused):
        _check(patterns, url)


def test_a_pattern_naming_a_private_host_allows_it():
    _check(["http://127.0.0.1:8123/*"], "http://127.0.0.1:8123/mcp")
    _check(["http://10.0.0.7/*"], "http://10.0.0.7/mcp")
