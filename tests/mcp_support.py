"""Real MCP servers for the MCP tests: the SDK server of mcp_tool_server.py as a stdio
child, or over streamable HTTP on 127.0.0.1 in a thread; what they received."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

SERVER_SCRIPT = Path(__file__).resolve().parent / "mcp_tool_server.py"
SECRET = "s3cret-value-never-shown"


def stdio_spec(name: str, log: Path, timeout: float = 60.0, slow: float = 2.0):
    """The stdio server as the operator's config names it (its env holds a secret;
    ``slow`` times out after ``slow`` seconds, the others after ``timeout``)."""
    from mlx_voicechat_plugin.server.mcp.config import parse_server

    return parse_server(name, {"command": sys.executable, "args": [str(SERVER_SCRIPT)],
                               "env": {"MCP_CALL_LOG": str(log), "MCP_SECRET": SECRET},
                               "timeout": timeout, "toolTimeouts": {"slow": slow}})


def calls(log: Path) -> list[dict]:
    """The calls the server received, in order."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def children(script: str = SERVER_SCRIPT.name) -> list[int]:
    """Our child processes running ``script`` (stdio servers not yet reaped)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and script.encode() in cmdline:
            found.append(int(entry))
    return found


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class HttpMcpServer:
    """The SDK server over streamable HTTP on 127.0.0.1 (a thread) until :meth:`stop`;
    ``headers`` records each request's headers."""

    def __init__(self, log: Path):
        import uvicorn
        from mcp_tool_server import server

        os.environ["MCP_CALL_LOG"] = str(log)
        app = server("http-tools").streamable_http_app()
        self.headers: list[dict] = []
        seen = self.headers

        async def recording(scope, receive, send):
            if scope["type"] == "http":
                seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
            await app(scope, receive, send)

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(recording, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "MCP server down"
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


@pytest.fixture(scope="module")
def mcp_log(tmp_path_factory):
    """Where the module's MCP server writes the calls it received."""
    return tmp_path_factory.mktemp("mcp") / "calls.jsonl"


@pytest.fixture(scope="module")
def mcp_server(mcp_log):
    """The module's streamable-HTTP MCP server."""
    server = HttpMcpServer(mcp_log)
    yield server
    server.stop()


def ga_until(ws, kind: str, events: list[dict], timeout: float = 90) -> dict:
    """GA events (each validated strictly, kept in ``events``) up to one of ``kind``."""
    from ga_schema import check
    from server_support import recv

    while True:
        one = recv(ws, timeout)
        check(one)  # against the openai package's RealtimeServerEvent
        events.append(one)
        if one["type"] == kind:
            return one
