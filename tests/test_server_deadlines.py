"""Deadlines on every phase of a connection, and room kept for the clients that matter.

Issue 63, findings 2 and 6: a client that completed ``GET /health``, sent one
byte of its next request and stopped held its socket for ever (the header
deadline was armed only for a connection's first request), so 128 such sockets
from two addresses locked everyone out; four transcription uploads stalled
mid-body held every in-flight slot for ever and kept the process alive after
SIGTERM past ``--drain-seconds``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import pytest
from fastapi import FastAPI, WebSocket
from server_support import LiveServer, ServerProcess, configure, connect, send, until_closed

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.operations.drain import CLOSE_SECONDS
from mlx_voicechat_plugin.server.transport.guard import address_group

KEY = "deadline-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
UPLOAD = "/v1/audio/transcriptions"


def _open(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def _response(sock: socket.socket) -> bytes:
    """One whole response (headers and a Content-Length body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(4096)
    return head


def _kept_alive_slowloris(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that completed ``GET /health``, then sent one byte of the next request."""
    sock = _open(port, source)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _response(sock).startswith(b"HTTP/1.1 200")
    sock.sendall(b"G")
    return sock


def _closed_by_server(sock: socket.socket, wait: float) -> bool:
    sock.settimeout(wait)
    try:
        while True:
            if sock.recv(4096) == b"":
                return True
    except TimeoutError:  # still open
        return False
    except OSError:  # reset by the server
        return True


def _quiet(server: LiveServer) -> None:
    guard = server.server.config.http.guard
    deadline = time.monotonic() + 5
    while guard.open and time.monotonic() < deadline:  # the start-up health polls' sockets
        time.sleep(0.05)


@pytest.fixture
def keyed(tiny_ckpt, request):
    limits = ServerLimits(**{"max_connections": 12, "max_connections_per_client": 6,
                             "header_timeout": 30.0, **getattr(request, "param", {})})
    server = LiveServer(create_app(tiny_ckpt, api_key=KEY, limits=limits))
    _quiet(server)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("keyed", [{"header_timeout": 1.0}], indirect=True)
def test_the_next_request_on_a_kept_alive_connection_has_a_header_deadline(keyed):
    sock = _kept_alive_slowloris(keyed.port)
    try:
        started = time.monotonic()
        assert _closed_by_server(sock, 4.0)
        assert time.monotonic() - started < 3.0
    finally:
        sock.close()


@pytest.mark.parametrize("keyed", [{"max_connections": 128, "max_connections_per_client": 64}],
                         indirect=True)
def test_health_and_an_authenticated_upgrade_get_in_while_two_addresses_hold_every_slot(keyed):
    """Two addresses, each at its per-address cap (the defaults: 64 of 128), hold every
    socket with kept-alive slowloris requests; a third address is still served."""
    per_address = keyed.app.state.limits.max_connections_per_client
    held = [_kept_alive_slowloris(keyed.port, source) for source in ("127.0.0.2", "127.0.0.3")
            for _ in range(per_address)]
    assert len(keyed.server.config.http.guard.open) == keyed.app.state.limits.max_connections
    try:
        assert not any(_closed_by_server(sock, 0.01) for sock in held)
        third = httpx.HTTPTransport(local_address="127.0.0.4")
        with httpx.Client(transport=third, timeout=10) as client:
            assert client.get(keyed.http("/health")).status_code == 200
        with connect(keyed.ws(), additional_headers=AUTH,
                     source_address=("127.0.0.5", 0)) as ws:
            configure(ws)
            send(ws, {"type": "session.cancel"})
            assert until_closed(ws)[1] == 1000
        assert any(_closed_by_server(sock, 0.01) for sock in held)  # one gave way
    finally:
        for sock in held:
            sock.close()


def test_ipv6_addresses_count_by_their_64_prefix():
    """IPv6 addresses count by /64: one host's prefix is one client."""
    assert address_group(("2001:db8:1:2::1", 1, 0, 0)) == \
        address_group(("2001:db8:1:2:ffff::9", 2, 0, 0)) == "2001:db8:1:2::/64"
    assert address_group(("2001:db8:1:3::1", 1, 0, 0)) != address_group(("2001:db8:1:2::1", 1))
    assert address_group(("::ffff:10.0.0.7", 1, 0, 0)) == "10.0.0.7"
    assert address_group(("10.0.0.7", 1)) == "10.0.0.7"


def _stalled_upload(port: int) -> socket.socket:
    """A transcription upload whose body stops halfway."""
    sock = _open(port)
    boundary = "b0undary"
    sock.sendall((f"POST {UPLOAD} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                  "Content-Length: 100000\r\n\r\n"
                  f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                  "filename=\"a.wav\"\r\n\r\nRIFF").encode())
    return sock


@pytest.mark.parametrize("keyed", [{"body_timeout": 1.0, "max_transcriptions_in_flight": 4}],
                         indirect=True)
def test_stalled_uploads_time_out_and_free_their_slots(keyed):
    stalled = [_stalled_upload(keyed.port) for _ in range(4)]
    try:
        time.sleep(0.3)
        full = httpx.post(keyed.http(UPLOAD), headers=AUTH, timeout=10,
                          files={"file": ("a.wav", b"RIFF", "audio/wav")})
        assert full.status_code == 429  # the four hold every slot until their deadline
        for sock in stalled:
            sock.settimeout(4.0)
            assert sock.recv(4096).startswith(b"HTTP/1.1 408")
            assert _closed_by_server(sock, 2.0)
        after = httpx.post(keyed.http(UPLOAD), headers=AUTH, timeout=10,
                           files={"file": ("a.wav", b"RIFF", "audio/wav")})
        assert after.status_code == 400, after.text  # admitted: a bad WAV, not a full server
    finally:
        for sock in stalled:
            sock.close()


def test_sigterm_exits_within_the_drain_while_uploads_stall(tiny_ckpt, tmp_path):
    drain_seconds = 1.0
    process = ServerProcess("mlx_voicechat_plugin.cli.main",
                            ["serve", "-m", str(tiny_ckpt), "--no-compile", "--api-key", KEY,
                             "--drain-seconds", str(drain_seconds), "--body-timeout", "600",
                             "--log-level", "info"], tmp_path / "serve.log")
    stalled: list[socket.socket] = []
    try:
        stalled = [_stalled_upload(process.port) for _ in range(4)]
        time.sleep(0.5)
        started = time.monotonic()
        process.process.send_signal(signal.SIGTERM)
        # Before, the process waited for the uploads for ever; now the drain ends them. The
        # bound leaves room for the interpreter's exit on a loaded machine.
        assert process.process.wait(drain_seconds + CLOSE_SECONDS + 20) == 0, process.output()
        assert time.monotonic() - started < drain_seconds + CLOSE_SECONDS + 8, process.output()
        assert "drained" in process.output()
    finally:
        for sock in stalled:
            sock.close()
        process.stop()


@pytest.mark.parametrize("keyed", [{"header_timeout": 0.5}], indirect=True)
def test_an_open_websocket_outlives_the_header_deadline(keyed):
    with connect(keyed.ws(), additional_headers=AUTH) as ws:
        configure(ws)
        time.sleep(1.5)
        send(ws, {"type": "session.ping"})
        assert json.loads(ws.recv(timeout=5))["type"] == "session.pong"
        send(ws, {"type": "session.cancel"})
        assert until_closed(ws)[1] == 1000


def test_a_websocket_handshake_the_app_never_answers_has_a_deadline():
    app = FastAPI()
    app.state.limits = ServerLimits(header_timeout=0.5)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.websocket("/ws")
    async def never_answers(websocket: WebSocket) -> None:
        await asyncio.sleep(5)

    server = LiveServer(app)
    try:
        sock = _open(server.port)  # a valid upgrade the app neither accepts nor refuses
        sock.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     b"Sec-WebSocket-Version: 13\r\n\r\n")
        started = time.monotonic()
        assert _closed_by_server(sock, 2.5)
        assert time.monotonic() - started < 2.0
        sock.close()
    finally:
        server.stop()
