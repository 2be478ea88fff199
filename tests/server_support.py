"""A real uvicorn server in a thread and a real WebSocket client, for the server tests."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import uvicorn
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

FRAME = 1280
TIMEOUT = 10.0


class LiveServer:
    """Serves an ASGI app on 127.0.0.1 and a free port until :meth:`stop`."""

    def __init__(self, app: Any, ws_max_size: int = 16 * 2**20, wait_ready: bool = True):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        # The server's socket-level limits (connection caps, header timeout)
        # as `mlx-voicechat serve` applies them.
        limits = getattr(getattr(app, "state", None), "limits", None)
        options = limits.uvicorn_options() if limits is not None else {}
        options["ws_max_size"] = ws_max_size
        config = uvicorn.Config(app, log_level="warning", lifespan="on", **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + TIMEOUT
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        if wait_ready:
            self.wait_health(200)

    def http(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def ws(self, path: str = "/v1/realtime") -> str:
        return f"ws://127.0.0.1:{self.port}{path}"

    def health(self, path: str = "/health") -> httpx.Response:
        return httpx.get(self.http(path), timeout=TIMEOUT)

    def wait_health(self, status: int, path: str = "/health") -> dict:
        deadline = time.monotonic() + TIMEOUT
        while True:
            response = self.health(path)
            if response.status_code == status or time.monotonic() > deadline:
                assert response.status_code == status, response.text
                return response.json()
            time.sleep(0.02)

    def wait_idle(self, path: str = "/health") -> None:
        deadline = time.monotonic() + TIMEOUT
        while self.health(path).json().get("session_active"):
            assert time.monotonic() < deadline, "session never released"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now: each stays bound until all are picked, so the
    kernel cannot hand one out twice (two ``free_port`` calls can get the same)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


class ServerProcess:
    """``python -m MODULE ARGS --host 127.0.0.1 --port FREE`` run as a user would, until
    :meth:`stop`; its output goes to ``log`` (a file, readable while it runs)."""

    def __init__(self, module: str, args: list[str], log: Path, env: dict | None = None,
                 startup_seconds: float = 120, port: int | None = None):
        self.port = port or free_port()
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, *args, "--host", "127.0.0.1",
                 "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + startup_seconds
        while True:
            try:
                if httpx.get(self.http("/health"), timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server never became healthy:\n{self.output()}")
            time.sleep(0.1)

    def http(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def ws(self, path: str = "/v1/realtime") -> str:
        return f"ws://127.0.0.1:{self.port}{path}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.process)


def running(live: "LiveServer"):
    """Fixture body: yield a started server, stop it at teardown."""
    try:
        yield live
    finally:
        live.stop()


def idle_connection(live: "LiveServer"):
    """Fixture body: a client connected once the previous session was released."""
    live.wait_idle()
    with connect(live.ws()) as client:
        yield client


class FailingVoiceChat:
    """Wraps a loaded VoiceChat session: a stream's push raises while ``fails(stream)``."""

    def __init__(self, inner: Any, fails: Any):
        self.inner, self.config, self.fails = inner, inner.config, fails

    def create_streaming_session(self, **options: Any) -> Any:
        stream = self.inner.create_streaming_session(**options)
        check = stream.check_frame  # asked before each frame the pool runs

        def failing_check() -> None:
            if self.fails(stream):
                raise RuntimeError("model exploded")
            check()

        stream.check_frame = failing_check
        return stream


def connect(url: str, **kwargs: Any):
    return ws_connect(url, max_size=None, open_timeout=TIMEOUT, **kwargs)


def send(ws: Any, payload: Any) -> None:
    ws.send(payload if isinstance(payload, (str, bytes)) else json.dumps(payload))


def recv(ws: Any, timeout: float = TIMEOUT) -> dict:
    return json.loads(ws.recv(timeout=timeout))


def expect_error(ws: Any, code: str) -> dict:
    event = recv(ws)
    assert event["type"] == "error", event
    assert event["error"]["code"] == code, event
    return event


def configure(ws: Any, **session: Any) -> dict:
    """Read ``session.created``, send ``session.update``; return ``session.updated``."""
    created = recv(ws)
    assert created["type"] == "session.created", created
    send(ws, {"type": "session.update", "session": session})
    updated = recv(ws)
    assert updated["type"] == "session.updated", updated
    return updated


def until_closed(ws: Any, timeout: float = TIMEOUT) -> tuple[list[dict], int | None]:
    """Every event until the server closes; and the close code."""
    events: list[dict] = []
    try:
        while True:
            events.append(recv(ws, timeout))
    except ConnectionClosed as closed:
        return events, closed.rcvd.code if closed.rcvd else None


def pcm16(samples: np.ndarray) -> bytes:
    return np.clip(np.round(np.asarray(samples) * 32768.0), -32768, 32767).astype("<i2").tobytes()


def append_message(samples: np.ndarray, **extra: Any) -> dict:
    return {"type": "input_audio_buffer.append",
            "audio": base64.b64encode(pcm16(samples)).decode("ascii"), **extra}


def as_received(samples: np.ndarray) -> np.ndarray:
    """The float samples the server sees for ``samples`` sent as PCM16."""
    return np.frombuffer(pcm16(samples), dtype="<i2").astype(np.float32) / 32768.0


def decode_audio(event: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(event["delta"]), dtype="<i2")


def connect_storm(live: "LiveServer", clients: int, slots: int) -> list[tuple[str, int | None]]:
    """``clients`` connect at once; the admitted hold their sessions until every other
    client has been answered, then cancel. Returns each client's outcome:
    ``("created", None)`` or ``(error code, close code)``."""
    start = threading.Barrier(clients)
    release = threading.Event()
    results: list[tuple[str, int | None]] = []
    lock = threading.Lock()

    def client() -> None:
        start.wait(10)
        with connect(live.ws()) as ws:
            first = recv(ws)
            if first["type"] == "session.created":
                with lock:
                    results.append(("created", None))
                release.wait(20)
                send(ws, {"type": "session.cancel"})
                until_closed(ws)
                return
            _, code = until_closed(ws)
            with lock:
                results.append((first["error"]["code"], code))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(results) < clients and time.monotonic() < deadline:
        refused = sum(1 for r in results if r[0] != "created")
        if refused >= clients - slots or results.count(("created", None)) > slots:
            release.set()  # everyone else has been answered: let the holders go
        time.sleep(0.02)
    release.set()
    for thread in threads:
        thread.join(20)
    return results


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s; reaped either way."""
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
