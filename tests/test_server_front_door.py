"""What a newcomer meets at the server's door: a wrong path is 404, a killed client frees
its slot within seconds (a WebSocket and a WebRTC call, each a real client process
killed with SIGKILL while it holds the only slot of ``--max-sessions 1``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from server_support import TIMEOUT, LiveServer, configure, connect, recv, running
from websockets.exceptions import InvalidStatus

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits

API_KEY = "test-key"
FREED_WITHIN = 8.0  # seconds from the kill to a new session's start (WebRTC: ~5 s of consent)
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    from mlx_voicechat_plugin.server.transport.ice import ICEConfig
    from rtc_support import LOOPBACK

    limits = ServerLimits(max_sessions=1, update_timeout=10, idle_timeout=120)
    yield from running(LiveServer(create_app(tiny_ckpt, api_key=API_KEY, limits=limits,
                                             ice=ICEConfig(hosts=LOOPBACK))))


AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.mark.parametrize("path", ["/v1/realtime-typo", "/openai/v1/nope", "/"])
def test_a_websocket_to_a_wrong_path_is_404_naming_the_endpoints(server, path):
    with pytest.raises(InvalidStatus) as refused:
        with connect(server.ws(path), additional_headers=AUTH):
            pass
    response = refused.value.response
    assert response.status_code == 404
    error = json.loads(response.body)["error"]
    assert error["code"] == "not_found"
    assert "/v1/realtime" in error["message"]


def _held_slot(script: str, *args: str) -> subprocess.Popen:
    """A client process that prints ``ready`` once it holds the slot, then waits."""
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args],
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   [str(TESTS), os.environ.get("PYTHONPATH", "")])})
    line = process.stdout.readline()
    assert line.strip() == "ready", line
    return process


def _killed(process: subprocess.Popen) -> float:
    process.send_signal(signal.SIGKILL)
    process.wait(TIMEOUT)
    return time.monotonic()


def _new_session_starts(server, since: float) -> float:
    """Seconds from ``since`` until a new WebSocket session is admitted (polling)."""
    while True:
        with connect(server.ws(), additional_headers=AUTH) as ws:
            event = recv(ws)
            if event["type"] == "session.created":
                configure_rest(ws)
                return time.monotonic() - since
            assert event["error"]["code"] == "server_busy", event
        assert time.monotonic() - since < 30, "the slot was never freed"
        time.sleep(0.2)


def configure_rest(ws) -> None:
    ws.send(json.dumps({"type": "session.update", "session": {}}))
    assert recv(ws)["type"] == "session.updated"


WEBSOCKET_CLIENT = """
    import sys, time
    from server_support import configure, connect
    ws = connect(sys.argv[1], additional_headers={"Authorization": "Bearer " + sys.argv[2]})
    configure(ws)
    print("ready", flush=True)
    time.sleep(600)
"""


def test_a_killed_websocket_client_frees_the_only_slot_within_seconds(server):
    server.wait_idle()
    holder = _held_slot(WEBSOCKET_CLIENT, server.ws(), API_KEY)
    assert _new_session_starts(server, _killed(holder)) < FREED_WITHIN


WEBRTC_CLIENT = """
    import asyncio, sys
    from rtc_support import Caller

    async def main():
        caller = Caller(sys.argv[1], sys.argv[2])
        await caller.dial({"type": "realtime"})
        await caller.until("session.created")
        print("ready", flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
"""


def test_a_killed_webrtc_caller_frees_the_only_slot_within_seconds(server):
    pytest.importorskip("aiortc")
    server.wait_idle()
    holder = _held_slot(WEBRTC_CLIENT, server.http("/openai/v1"), API_KEY)
    assert _new_session_starts(server, _killed(holder)) < FREED_WITHIN
