"""Backpressure: a client that stops reading cannot make the server buffer without bound.

Related limits tested elsewhere: the update deadline (``test_server_limits.py::
test_no_session_update_within_the_update_timeout_closes_with_1008`` and
``test_a_timed_out_connection_releases_the_session``) and the 1 MiB message
cap checked before decoding (``test_a_message_over_the_limit_is_rejected_before
_decoding_and_the_loop_continues``, ``test_a_message_over_the_transport_cap
_closes_with_1009``).
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from raw_client import RawClient
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    configure,
    connect,
    running,
    send,
    until_closed,
)

from mlx_voicechat_plugin.cli import serve
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits

LIMITS = ServerLimits(max_pending_events=16, send_timeout=1.0, update_timeout=5, idle_timeout=5)
CHUNK_FRAMES = 8
MAX_CHUNKS = 60  # ~480 frames: far more than the socket buffers and the queue hold
SEND_BUFFER = 4096  # accepted sockets inherit it; keeps the kernel from absorbing megabytes


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    live = LiveServer(create_app(tiny_ckpt, limits=LIMITS))
    live.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    yield from running(live)


def _stall(server) -> RawClient:
    """A client that configures, then only sends appends until its session is dropped."""
    client = RawClient(server.port)
    client.send_json({"type": "session.update", "session": {}})
    chunk = append_message(np.zeros(CHUNK_FRAMES * FRAME, np.float32))
    for _ in range(MAX_CHUNKS):
        try:
            client.send_json(chunk)
        except OSError:  # the server already closed
            break
        time.sleep(0.02)
        if not server.health().json()["session_active"]:
            break
    return client


def test_a_client_that_stops_reading_is_closed_and_its_session_freed(server):
    server.wait_idle()
    client = _stall(server)
    try:
        server.wait_idle()  # freed without the client reading a byte
        with connect(server.ws()) as ws:
            configure(ws)
            send(ws, {"type": "input_audio_buffer.commit"})
            assert until_closed(ws)[1] == 1000
        closing = client.close_frame()
        assert closing is None or closing == (1008, "client is not reading")
    finally:
        client.close()


CLOSED_WITHIN = 8.0  # seconds from the session's end: the close wait, the grace, slack
TCP_ESTABLISHED = 1  # Linux's tcpi_state (the first byte of TCP_INFO)


def _tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="reads the socket's TCP state (Linux)")
def test_a_client_that_never_reads_has_its_socket_closed_within_seconds(server):
    """The close handshake cannot wait on a client that reads nothing: once the session
    has ended, the server aborts the socket, and the client sees it without reading."""
    server.wait_idle()
    client = _stall(server)
    try:
        server.wait_idle()
        deadline = time.monotonic() + CLOSED_WITHIN
        while _tcp_state(client.sock) == TCP_ESTABLISHED:
            assert time.monotonic() < deadline, "the server kept the socket open"
            time.sleep(0.1)
    finally:
        client.close()


def test_a_reading_client_is_never_closed_for_backpressure(server):
    server.wait_idle()
    with connect(server.ws()) as ws:
        configure(ws)
        send(ws, append_message(np.zeros(40 * FRAME, np.float32)))
        send(ws, {"type": "input_audio_buffer.commit"})
        events, code = until_closed(ws)
    assert code == 1000
    assert sum(e["type"] == "response.audio.delta" for e in events) >= 40


def test_the_pending_event_bound_is_a_flag():
    args = serve.parse(["-m", "ckpt", "--max-pending-events", "7", "--send-timeout", "2"],
                       "serve", False)
    assert args.limits.max_pending_events == 7 and args.limits.send_timeout == 2.0
    with pytest.raises(ValueError):
        ServerLimits(max_pending_events=0)


def test_the_pending_byte_bound_is_a_flag():
    args = serve.parse(["-m", "ckpt", "--max-pending-bytes", "65536"], "serve", False)
    assert args.limits.max_pending_bytes == 65536
    assert serve.parse(["-m", "ckpt"], "serve", False).limits.max_pending_bytes == 8 * 2**20
    with pytest.raises(ValueError, match="max_pending_bytes"):
        ServerLimits(max_pending_bytes=0)
