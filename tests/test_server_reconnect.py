"""A client that hangs up cleanly and calls straight back gets the slot it just left.

With ``--max-sessions 1`` the one slot must be free for a client that connects
again the moment its close handshake is complete, whichever side sent the
close frame. The WebSocket layer answers a client's close frame in the same
step as it hands the application the disconnect, so the slot must be freed
as soon as that disconnect is received, not when the connection's task gets
round to it. The client is a raw socket that drops the TCP connection as soon
as the handshake is done (as a browser may), not one that waits for the
server to close it first.
"""

from __future__ import annotations

import json
import struct

import pytest
from raw_client import RawClient
from server_support import LiveServer, running

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits

RECONNECTS = 200
CLOSE, NORMAL = 0x8, 1000


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=5, idle_timeout=5, max_sessions=1)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits)))


def _event(client: RawClient) -> dict:
    _, payload = client.read_frame()
    return json.loads(payload)


def _client_hangs_up(client: RawClient) -> None:
    client.send_frame(struct.pack("!H", NORMAL), opcode=CLOSE)
    assert client.close_frame()[0] == NORMAL  # the server's answer: handshake complete


def _server_hangs_up(client: RawClient) -> None:
    client.send_json({"type": "input_audio_buffer.commit"})
    assert client.close_frame()[0] == NORMAL
    client.send_frame(struct.pack("!H", NORMAL), opcode=CLOSE)  # the client's answer


def _reconnect_refusals(server, hang_up, path: str = "/v1/realtime",
                        session: dict | None = None) -> list[dict]:
    refused = []
    for _ in range(RECONNECTS):
        client = RawClient(server.port, path)
        try:
            first = _event(client)
            if first["type"] != "session.created":
                refused.append(first.get("error", first))
                continue
            client.send_json({"type": "session.update", "session": session or {}})
            assert _event(client)["type"] == "session.updated"
            hang_up(client)
        finally:
            client.close()  # at once: no wait for the server's TCP close
    return refused


def test_two_hundred_reconnects_after_the_client_closes_are_all_admitted(server):
    server.wait_idle()
    assert _reconnect_refusals(server, _client_hangs_up) == []


def test_two_hundred_reconnects_after_the_server_closes_are_all_admitted(server):
    server.wait_idle()
    assert _reconnect_refusals(server, _server_hangs_up) == []



def test_two_hundred_reconnects_on_the_ga_route_are_all_admitted(server):
    """The OpenAI GA dialect reads the socket through the same receive."""
    server.wait_idle()
    assert _reconnect_refusals(server, _client_hangs_up, "/openai/v1/realtime",
                               {"type": "realtime"}) == []
