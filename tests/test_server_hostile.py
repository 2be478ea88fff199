"""The server under a hostile client: one test per finding of the adversarial run.

Each test failed on the code before the fix (the finding's number is in the
test's docstring): unbounded echoes, nesting that crashed the parser, idle
time reset by no-ops, a commit at the length limit that never ended, cancel
without ``response.cancelled``, a reconnect refused while the slot was freed,
origins judged from ``Host``, names and seeds checked loosely, and API docs
served outside the key and prefix.
"""

from __future__ import annotations

import json
import logging
import time

import httpx
import numpy as np
import pytest
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    configure,
    connect,
    expect_error,
    idle_connection,
    recv,
    running,
    send,
    until_closed,
)
from tool_support import short_tool_prompt
from websockets.exceptions import InvalidStatus

from mlx_voicechat_plugin.server import wire
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.routes.access import origin_allowed
from mlx_voicechat_plugin.server.limits import ServerLimits

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
LIMITS = ServerLimits(max_message_bytes=4 * 2**20, max_session_seconds=0.16, idle_timeout=1.0,
                      update_timeout=5.0, max_session_wall_seconds=6.0, max_failed_updates=3)


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    app = create_app(tiny_ckpt, limits=LIMITS)
    yield from running(LiveServer(app, ws_max_size=LIMITS.transport_max_bytes))


@pytest.fixture
def ws(server):
    yield from idle_connection(server)


def _pong(ws) -> None:
    send(ws, {"type": "session.ping"})
    assert recv(ws)["type"] == "session.pong"


# --- 2: nesting -----------------------------------------------------------


@pytest.mark.parametrize("depth", [wire.MAX_JSON_DEPTH + 1, 1200])
def test_deeply_nested_json_is_an_invalid_request_and_the_connection_lives(ws, depth):
    """Finding 2: ~970+ levels raised RecursionError and dropped the connection."""
    recv(ws)
    send(ws, '{"type": "session.update", "session": {"x": ' + "[" * depth + "]" * depth + "}}")
    error = expect_error(ws, "invalid_request")
    assert str(wire.MAX_JSON_DEPTH) in error["error"]["message"]
    _pong(ws)


def test_json_depth_counts_without_recursion():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert wire.json_depth(deep) > wire.MAX_JSON_DEPTH
    assert wire.json_depth({"a": [1, {"b": 2}]}) == 3 and wire.json_depth(7) == 0


# --- 4: echoes and repeated failures ------------------------------------


def test_errors_quote_at_most_a_short_prefix_of_client_input(ws, monkeypatch):
    """Finding 4: a 500 KB call_id or tool name came back whole."""
    # The rendered tool block is ~480 prefill positions: seconds of this
    # module's 6 s wall-clock cap on a loaded 2-core machine. The rule under
    # test is the error text, not the prefill.
    short_tool_prompt(monkeypatch)
    configure(ws, tools=[WEATHER])
    send(ws, {"type": "conversation.item.create",
              "item": {"type": "function_call_output", "call_id": "c" * 500_000, "output": "{}"}})
    error = expect_error(ws, "invalid_request")
    assert len(error["error"]["message"]) <= wire.MAX_ERROR_CHARS
    _pong(ws)


def test_a_huge_tool_definition_error_is_bounded(ws):
    recv(ws)
    tool = dict(WEATHER, name="n" * 200_000, **{f"k{i}": 0 for i in range(15_000)})
    send(ws, {"type": "session.update", "session": {"tools": [tool]}})
    error = expect_error(ws, "session_initialization_failed")
    assert len(json.dumps(error)) < 1000


def test_repeated_failed_updates_close_the_connection_and_log_once_each(ws, caplog):
    """Finding 4: failed session.update could be repeated forever, each logged twice."""
    caplog.set_level(logging.DEBUG, logger="mlx_voicechat_plugin")
    recv(ws)
    bad = {"type": "session.update", "session": {"tools": [dict(WEATHER, name="bad name")]}}
    for _ in range(LIMITS.max_failed_updates - 1):
        send(ws, bad)
        expect_error(ws, "session_initialization_failed")
    send(ws, bad)
    events, code = until_closed(ws)
    assert code == 1008 and events[0]["error"]["code"] == "session_initialization_failed"
    logged = [r for r in caplog.records if r.levelno >= logging.INFO and "bad name" in r.getMessage()]
    assert len(logged) == LIMITS.max_failed_updates


# --- 6: idle and wall clock ---------------------------------------------


def test_no_op_messages_do_not_keep_a_session_alive(ws):
    """Finding 6: empty appends and failing tool outputs reset the idle timeout."""
    configure(ws)
    started = time.monotonic()
    try:
        while time.monotonic() - started < 4 * LIMITS.idle_timeout:
            send(ws, append_message(np.zeros(0, np.float32)))
            send(ws, {"type": "conversation.item.create",
                      "item": {"type": "function_call_output", "call_id": "x", "output": "{}"}})
            time.sleep(0.2)
    except Exception:
        pass  # the server closed while we were sending
    events, code = until_closed(ws)
    assert code == 1008
    assert time.monotonic() - started < 3 * LIMITS.idle_timeout
    assert any("idle" in e.get("error", {}).get("message", "") for e in events)


def test_a_session_has_a_wall_clock_cap(tiny_ckpt):
    """Finding 6: audio every half second kept a session open without end."""
    limits = ServerLimits(idle_timeout=5.0, max_session_wall_seconds=1.5,
                          max_session_seconds=600.0)
    server = LiveServer(create_app(tiny_ckpt, limits=limits))
    try:
        with connect(server.ws()) as ws:
            configure(ws)
            started = time.monotonic()
            with pytest.raises(Exception):
                for _ in range(40):
                    send(ws, append_message(np.zeros(160, np.float32)))
                    time.sleep(0.2)
                    while True:  # drain
                        event = recv(ws, timeout=0.05)
                        if event["type"] == "error":
                            raise RuntimeError(event["error"]["message"])
            assert time.monotonic() - started < 4.0
    finally:
        server.stop()


# --- 7: the length limit and cancel --------------------------------------


def test_a_commit_at_the_length_limit_still_ends_with_response_done(ws):
    """Finding 7: committed, then inference_error, never response.done."""
    configure(ws)
    send(ws, append_message(np.zeros(2 * FRAME, np.float32)))  # exactly the 0.16 s limit
    send(ws, append_message(np.zeros(600, np.float32)))  # a partial frame past it
    send(ws, {"type": "input_audio_buffer.commit"})
    events, code = until_closed(ws)
    kinds = [e["type"] for e in events]
    assert "error" not in kinds and kinds[-1] == "response.done" and code == 1000
    assert [e["frame_index"] for e in events if e["type"] == "response.audio.delta"] == [0, 1]


def test_cancel_after_the_limit_sends_response_cancelled(ws):
    """Finding 7: a cancel after the limit closed 1000 without response.cancelled."""
    configure(ws)
    send(ws, append_message(np.zeros(3 * FRAME, np.float32)))
    while recv(ws)["type"] != "error":
        pass
    send(ws, {"type": "session.cancel"})
    events, code = until_closed(ws)
    assert events[-1]["type"] == "response.cancelled" and code == 1000


# --- 8: reconnecting -----------------------------------------------------


def test_an_immediate_reconnect_after_a_clean_close_is_admitted(server):
    """Finding 8: about half the reconnects got server_busy for ~10 ms."""
    server.wait_idle()
    for _ in range(12):
        with connect(server.ws()) as ws:
            configure(ws)
            send(ws, {"type": "session.cancel"})
            assert until_closed(ws)[1] == 1000
        with connect(server.ws()) as again:
            assert recv(again)["type"] == "session.created"


# --- 9: origins ----------------------------------------------------------


@pytest.mark.parametrize("origin,allowed", [
    ("http://localhost:5173", True), ("http://127.0.0.1:8080", True), ("https://[::1]:1", True),
    ("http://attacker.example:8080", False), ("", False), ("null", False),
    ("file://localhost", False), ("chrome-extension://abc", False), ("http://localhost:x", False),
    (None, True),  # no Origin: not a browser
])
def test_origin_policy_without_a_list(origin, allowed):
    assert origin_allowed(origin, ()) is allowed


def test_a_listed_origin_is_the_only_browser_origin_allowed():
    assert origin_allowed("https://app.example", ["https://app.example"])
    assert not origin_allowed("http://localhost:3000", ["https://app.example"])


def test_a_dns_rebinding_page_is_refused(server):
    """Finding 9: Host and Origin both attacker.example:PORT were accepted."""
    forged = f"attacker.example:{server.port}"
    with pytest.raises(InvalidStatus) as caught:
        with connect(server.ws(), origin=f"http://{forged}",
                     additional_headers={"Host": forged}):
            pass
    assert caught.value.response.status_code == 403


# --- 10: names, seeds, docs ----------------------------------------------


def test_a_tool_name_with_a_trailing_newline_is_refused(ws):
    """Finding 10: re.match with $ let 'get_weather\\n' through."""
    recv(ws)
    send(ws, {"type": "session.update", "session": {"tools": [dict(WEATHER, name="get_weather\n")]}})
    assert "name" in expect_error(ws, "session_initialization_failed")["error"]["message"]


def test_a_huge_seed_is_a_clear_initialization_error(ws):
    """Finding 10: a 3,000-digit seed returned MLX's raw binding error."""
    recv(ws)
    send(ws, '{"type": "session.update", "session": {"seed": ' + "9" * 3000 + "}}")
    message = expect_error(ws, "session_initialization_failed")["error"]["message"]
    assert "session.seed" in message and "2**64 - 1" in message and len(message) < 200


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_no_api_docs_are_served(server, path):
    """Finding 10: /docs, /openapi.json and /redoc were open without the key."""
    assert httpx.get(server.http(path), timeout=5).status_code == 404


# --- 1: prompt prefill -----------------------------------------------------


def test_a_prompt_over_the_token_limit_is_refused_before_any_work(ws):
    """Finding 1: a 10 KB system prompt held the only engine for 71 s."""
    recv(ws)
    started = time.monotonic()
    send(ws, {"type": "session.update", "session": {"system_prompt": "x" * 10_000}})
    message = expect_error(ws, "session_initialization_failed")["error"]["message"]
    assert "max_prompt_tokens=2048" in message and time.monotonic() - started < 5
    _pong(ws)


@pytest.fixture
def long_prefill_server(tiny_ckpt):
    limits = ServerLimits(max_prompt_tokens=100_000, max_message_bytes=4 * 2**20)
    server = LiveServer(create_app(tiny_ckpt, limits=limits), ws_max_size=8 * 2**20)
    try:
        yield server
    finally:
        server.stop()


def test_a_client_that_leaves_during_prefill_frees_the_slot_at_once(long_prefill_server):
    """Finding 1: dropping the connection did not stop a 270 s prefill."""
    server = long_prefill_server
    with connect(server.ws()) as ws:
        recv(ws)
        send(ws, {"type": "session.update", "session": {"system_prompt": "y" * 20_000}})
        time.sleep(0.5)  # the prefill is running
    left = time.monotonic()
    server.wait_idle()
    with connect(server.ws()) as again:
        configure(again)
        assert time.monotonic() - left < 5
        send(again, {"type": "session.cancel"})
        assert until_closed(again)[1] == 1000


def test_shutdown_stops_a_prefill(long_prefill_server):
    """Finding 1: SIGTERM hung while a prefill ran."""
    server = long_prefill_server
    with connect(server.ws()) as ws:
        recv(ws)
        send(ws, {"type": "session.update", "session": {"system_prompt": "z" * 20_000}})
        time.sleep(0.5)
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 8 and not server.thread.is_alive()


# --- 3: slow headers and connection floods ----------------------------------


def _half_request(port: int):
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
    return sock


def _closed_by_server(sock, wait: float) -> bool:
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except TimeoutError:  # still open
        return False
    except OSError:  # reset by the server
        return True


@pytest.fixture
def guarded_server(tiny_ckpt):
    limits = ServerLimits(max_connections=12, max_connections_per_client=6, header_timeout=1.0)
    server = LiveServer(create_app(tiny_ckpt, limits=limits))
    guard = server.server.config.http.guard
    deadline = time.monotonic() + 5
    while guard.open and time.monotonic() < deadline:  # the start-up health polls' sockets
        time.sleep(0.05)
    try:
        yield server
    finally:
        server.stop()


def test_slow_header_connections_are_capped_and_timed_out(guarded_server, caplog):
    """Finding 3: 300 slowloris sockets stayed open and starved /health."""
    server = guarded_server
    caplog.set_level(logging.WARNING, logger="mlx_voicechat_plugin")
    socks = [_half_request(server.port) for _ in range(10)]
    try:
        time.sleep(0.3)  # refusals are immediate; the header timeout is 1 s
        refused = [s for s in socks if _closed_by_server(s, 0.01)]
        assert len(refused) == 4  # six from this address are allowed in
        assert any("max-connections-per-client" in r.getMessage() for r in caplog.records)
        started = time.monotonic()
        assert all(_closed_by_server(s, 3.0) for s in socks)  # the header timeout
        assert time.monotonic() - started < 2.5
        assert any("header-timeout" in r.getMessage() for r in caplog.records)
        assert server.health().status_code == 200  # room again
    finally:
        for sock in socks:
            sock.close()


def test_websocket_sessions_count_until_they_close(guarded_server):
    server = guarded_server
    with connect(server.ws()) as ws:
        configure(ws)
        socks = [_half_request(server.port) for _ in range(6)]
        try:
            # The open WebSocket holds one of the six places of this address.
            time.sleep(0.3)
            assert sum(_closed_by_server(s, 0.01) for s in socks) == 1
        finally:
            for sock in socks:
                sock.close()
        send(ws, {"type": "session.cancel"})
        assert until_closed(ws)[1] == 1000
    time.sleep(0.2)
    assert server.health().status_code == 200


# --- 5: ping floods -------------------------------------------------------------


def test_a_ping_flood_from_a_client_that_never_reads_is_bounded(guarded_server):
    """Finding 5: server memory grew ~0.8 MB per MB of pings until the update timeout."""
    from raw_client import RawClient

    from mlx_voicechat_plugin.server.transport.guard import MAX_UNSENT_BYTES

    server = guarded_server
    guard = server.server.config.http.guard
    client = RawClient(server.port)
    sent = 0
    try:
        ping = b"p" * 125
        while sent < 6 * MAX_UNSENT_BYTES:
            client.sock.sendall(_masked_pings(ping, 512))
            sent += 512 * 125
    except OSError:
        pass  # the server closed the connection
    finally:
        client.close()
    assert sent < 6 * MAX_UNSENT_BYTES  # closed before the flood was through
    # At most the cap plus the pongs of one socket read (asyncio reads up to 256 KiB).
    assert guard.peak_unsent_bytes <= MAX_UNSENT_BYTES + 2**18
    time.sleep(0.2)
    assert server.health().status_code == 200


def _masked_pings(payload: bytes, count: int) -> bytes:
    import struct

    mask = bytes(4)  # a zero mask leaves the payload as is
    frame = struct.pack("!BB", 0x80 | 0x9, 0x80 | len(payload)) + mask + payload
    return frame * count
