"""A small MCP server built with the official SDK, for the MCP tests.

Run as a child (stdio, ``python mcp_tool_server.py``) or served in-process over
streamable HTTP (:func:`server`, ``streamable_http_app()``). Each call is
appended as a JSON line to the file named by ``MCP_CALL_LOG`` (if set): the tests
read what the server received there. Tools that misbehave on purpose: ``slow``
(hangs), ``crash`` (the process exits), ``garbage`` (writes non-protocol bytes
then hangs), ``huge`` (1 MiB), ``fail`` (the tool reports an error).
"""

from __future__ import annotations

import asyncio
import json
import os

from mcp.server.mcpserver import MCPServer


def _log(name: str, arguments: dict) -> None:
    path = os.environ.get("MCP_CALL_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "arguments": arguments, "pid": os.getpid()}) + "\n")


def server(name: str = "test-tools") -> MCPServer:
    mcp = MCPServer(name)

    @mcp.tool()
    def get_weather(city: str) -> dict:
        """Current weather for a city."""
        _log("get_weather", {"city": city})
        return {"city": city, "temp": 21}

    @mcp.tool()
    async def slow(seconds: float) -> str:
        """Waits, then answers."""
        _log("slow", {"seconds": seconds})
        await asyncio.sleep(seconds)
        return "done"

    @mcp.tool()
    def crash() -> str:
        """The server process exits."""
        _log("crash", {})
        os._exit(3)

    @mcp.tool()
    async def garbage() -> str:
        """Non-protocol bytes on stdout, then no answer."""
        _log("garbage", {})
        from mcp.server import stdio

        claim = stdio._claims.get(1)  # the SDK moves the wire off fd 1: write to the wire
        os.write(claim.private_fd if claim and claim.private_fd else 1, b"not json-rpc\n")
        await asyncio.sleep(3600)
        return "never"

    @mcp.tool()
    def huge() -> str:
        """A 1 MiB answer: 256 times the result bound, 16 pipe buffers."""
        _log("huge", {})
        return "x" * (1024 * 1024)

    @mcp.tool()
    def fail() -> str:
        """The tool reports an error."""
        _log("fail", {})
        raise ValueError("the tool failed on purpose")

    @mcp.tool()
    def has_secret() -> bool:
        """Whether the server's environment holds MCP_SECRET (never its value)."""
        _log("has_secret", {})
        return bool(os.environ.get("MCP_SECRET"))

    return mcp


if __name__ == "__main__":
    server().run()
