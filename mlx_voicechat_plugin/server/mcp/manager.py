"""The operator's MCP servers, connected once on the event loop and shared by every session.

:class:`McpManager` (owned by the app, started and closed by its lifespan) holds one
:class:`McpConnection` per server of the ``--mcp`` file. A connection is one task
on the loop that enters the SDK's transport (a stdio child process, or streamable
HTTP) and :class:`~mcp.ClientSession`, lists the tools, then waits to be stopped:
anyio's scopes are entered and left by that one task. Calls are made from the
sessions' tasks, each bounded by its server's ``timeout`` and ending in a result
or one :class:`~...runtime.tool_failures.ToolFailure`:

- the server closed or crashed (its child exited): ``server_error``, and the
  connection restarts after a backoff (0.5 s doubling to 30 s; after
  :data:`MAX_RESTARTS` failed starts in a row it stays down, logged);
- it wrote bytes that are not the protocol: ``bad_response`` for the calls in
  flight, and the same restart;
- no answer in time: ``timeout`` (the request is cancelled);
- the tool said ``isError``, or answered a JSON-RPC error: ``tool_error``;
- an answer over the byte bound: ``too_large``.

A stdio server's child is reaped when its connection stops (the SDK terminates
its process tree). Secrets (``env``, ``headers``) are never logged:
:meth:`~.config.McpServerSpec.describe`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import unicodedata
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Sequence

from ...runtime.tool_failures import (
    BAD_RESPONSE,
    DEFAULT_MAX_RESULT_BYTES,
    SERVER_ERROR,
    TIMEOUT,
    TOOL_ERROR,
    UNKNOWN_TOOL,
    ToolFailure,
    bounded_output,
)
from ...runtime.tools import ToolError, parse_tool
from .config import McpServerSpec
from .session_servers import UrlPolicy

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 30.0
BACKOFF_FIRST, BACKOFF_MOST = 0.5, 30.0
MAX_RESTARTS = 5
STOP_TIMEOUT = 5.0
MAX_LISTED_TOOLS = 64


def ascii_text(text: str) -> str:
    """``text`` in ASCII (the checkpoint's tool text): accents dropped, the rest ``?``."""
    folded = unicodedata.normalize("NFKD", text)
    return "".join(c if c.isascii() else "" if unicodedata.combining(c) else "?" for c in folded)


@dataclass(frozen=True)
class McpTool:
    """One tool an MCP server lists, as the model is offered it."""

    server: str  # the server's label (its name in the file, or the session's server_label)
    name: str  # the tool's name on its server and to the model
    spec: dict[str, Any]  # the function tool the model sees: name, description, parameters, acks
    timeout: float
    approval: bool = False  # the call waits for the client's approval
    owned: bool = False  # a server the session named (GA's mcp tool), not the operator's


def result_text(result: Any, max_bytes: int) -> str:
    """An MCP ``CallToolResult`` as the text the model hears (bounded), or its failure."""
    content = getattr(result, "content", None)
    if not isinstance(content, list):
        raise ToolFailure(BAD_RESPONSE, "the server's answer is not a tool result")
    parts = []
    for block in content:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', '?')} omitted]")
        if sum(map(len, parts)) > max_bytes:
            break
    text = "\n".join(parts)
    if getattr(result, "is_error", False):
        raise ToolFailure(TOOL_ERROR, text or "the tool reported an error")
    structured = getattr(result, "structured_content", None)
    if structured is not None and not text:
        text = json.dumps(structured)
    return bounded_output(text, max_bytes)


class McpConnection:
    """One MCP server: connected by one task on the loop, restarted with backoff."""

    def __init__(self, spec: McpServerSpec, *, connect_timeout: float = CONNECT_TIMEOUT,
                 backoff: tuple[float, float] = (BACKOFF_FIRST, BACKOFF_MOST),
                 max_restarts: int = MAX_RESTARTS, http_client: Any = None,
                 restart: bool = True):
        self.spec = spec
        self.restart = restart  # a session's own server is not restarted
        self.connect_timeout = connect_timeout
        self.backoff = backoff
        self.max_restarts = max_restarts
        self.http_client = http_client  # a test's or an operator's httpx2 client
        self.tools: dict[str, dict[str, Any]] = {}  # name -> {description, inputSchema}
        self.starts = 0  # connections made, restarts included
        self.failed_starts = 0  # in a row
        self.error = ""  # why it is down (no secrets)
        self._session: Any = None
        self._runner: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._broken: asyncio.Future | None = None  # resolves with the failure that broke it
        self._restart: asyncio.Task | None = None
        self._connected = asyncio.Event()
        self._closed = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def connected(self) -> bool:
        """Connected and not broken: calls go through."""
        broken = self._broken
        return self._session is not None and broken is not None and not broken.done()

    async def wait_connected(self, timeout: float) -> bool:
        """Whether it is connected within ``timeout`` seconds (a test's wait for a restart)."""
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # --- connecting -------------------------------------------------------------------

    def _transport(self) -> Any:
        if self.spec.command is not None:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            return stdio_client(StdioServerParameters(
                command=self.spec.command, args=list(self.spec.args), env=dict(self.spec.env),
                cwd=self.spec.cwd), errlog=_errlog())
        from mcp.client.streamable_http import streamable_http_client

        return streamable_http_client(self.spec.url, http_client=self._http())

    def _http(self) -> Any:
        if self.http_client is not None:
            return self.http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        return create_mcp_http_client(headers=dict(self.spec.headers))

    async def connect(self) -> None:
        """Connect (start the child, or reach the URL) and list the tools, or raise
        :class:`ToolFailure` (``server_error``) within ``connect_timeout``."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()
        self._stop, self._broken = asyncio.Event(), loop.create_future()
        self._runner = asyncio.ensure_future(self._run(ready, self._stop, self._broken))
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.connect_timeout)
        except asyncio.TimeoutError:
            await self._stop_runner()
            raise ToolFailure(SERVER_ERROR, f"MCP server {self.name} did not start within "
                                            f"{self.connect_timeout:g} s") from None
        except BaseException:
            await self._stop_runner()
            raise
        self.starts += 1
        self.failed_starts, self.error = 0, ""
        self._connected.set()
        logger.info("MCP server %s connected: %d tools (%s)", self.spec.describe(),
                    len(self.tools), ", ".join(self.tools))

    async def _run(self, ready: asyncio.Future, stop: asyncio.Event,
                   broken: asyncio.Future) -> None:
        """The connection's life, in this one task: enter, list, wait, leave."""
        failure = ToolFailure(SERVER_ERROR, f"the MCP server {self.name} closed")
        try:
            from mcp import ClientSession

            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport())

                async def on_message(message: Any) -> None:
                    if isinstance(message, Exception):  # not the protocol: bytes it cannot parse
                        self._break(broken, ToolFailure(
                            BAD_RESPONSE, f"the MCP server {self.name} sent bytes that are "
                                          f"not MCP ({type(message).__name__})"))

                session = await stack.enter_async_context(
                    ClientSession(read, write, message_handler=on_message))
                await session.initialize()
                self.tools = await self._list(session)
                self._session = session
                ready.set_result(None)
                waits = [asyncio.ensure_future(stop.wait()), broken]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waits[0].cancel()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - an ExceptionGroup from anyio too
            reason = _reason(exc)
            failure = ToolFailure(SERVER_ERROR, f"the MCP server {self.name} failed: {reason}")
            if not ready.done():
                ready.set_exception(ToolFailure(
                    SERVER_ERROR, f"MCP server {self.name} could not start: {reason}"))
        finally:
            self._session = None
            self._connected.clear()
            self._break(broken, failure)

    async def _list(self, session: Any) -> dict[str, dict[str, Any]]:
        tools: dict[str, dict[str, Any]] = {}
        cursor = None
        while len(tools) < MAX_LISTED_TOOLS:
            from mcp_types import PaginatedRequestParams

            listing = await session.list_tools(
                params=PaginatedRequestParams(cursor=cursor) if cursor else None)
            for tool in listing.tools[: MAX_LISTED_TOOLS - len(tools)]:
                tools[tool.name] = {"description": tool.description or "",
                                    "inputSchema": tool.input_schema}
            cursor = listing.next_cursor
            if not cursor:
                break
        return tools

    def _break(self, broken: asyncio.Future, failure: ToolFailure) -> None:
        """The connection is broken by ``failure``: calls in flight end with it; a restart
        follows (once; not after :meth:`close`)."""
        if broken.done():
            return
        broken.set_result(failure)
        self._connected.clear()
        self.error = failure.message
        if not self._closed:
            logger.warning("MCP server %s: %s", self.name, failure.message)
        if self.restart and not self._closed and self.starts and (
                self._restart is None or self._restart.done()):
            self._restart = asyncio.ensure_future(self._restart_later())

    async def _restart_later(self) -> None:
        """Connect again after a backoff that doubles with each failed start."""
        first, most = self.backoff
        while not self._closed:
            delay = min(first * 2 ** self.failed_starts, most)
            await asyncio.sleep(delay)
            await self._stop_runner()
            if self._closed:
                return
            try:
                await self.connect()
                logger.info("MCP server %s restarted (start %d)", self.name, self.starts)
                return
            except ToolFailure as failure:
                self.failed_starts += 1
                self.error = failure.message
                if self.failed_starts >= self.max_restarts:
                    logger.error("MCP server %s: %d failed starts in a row; it stays down: %s",
                                 self.name, self.failed_starts, failure.message)
                    return

    async def _stop_runner(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if self._stop is not None:
            self._stop.set()
        done, _ = await asyncio.wait({runner}, timeout=STOP_TIMEOUT)
        if not done:
            runner.cancel()
            await asyncio.wait({runner}, timeout=STOP_TIMEOUT)
        if runner.done() and not runner.cancelled():
            runner.exception()

    async def close(self) -> None:
        """Stop: the child process ends and is reaped; no restart follows."""
        self._closed = True
        if self._restart is not None and self._restart is not asyncio.current_task():
            self._restart.cancel()
            await asyncio.wait({self._restart})
        await self._stop_runner()

    # --- calling ----------------------------------------------------------------------

    async def call(self, tool: str, arguments: dict[str, Any], timeout: float,
                   max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> str:
        """``tool``'s result as text for the model, or :class:`ToolFailure`."""
        session, broken = self._session, self._broken
        if session is None or broken is None or broken.done():
            why = f": {self.error}" if self.error else ""
            raise ToolFailure(SERVER_ERROR, f"the MCP server {self.name} is not connected{why}")
        if tool not in self.tools:
            raise ToolFailure(UNKNOWN_TOOL, f"the MCP server {self.name} lists no tool {tool!r}")
        request = asyncio.ensure_future(session.call_tool(tool, arguments))
        try:
            done, _ = await asyncio.wait({request, broken}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            _drop(request)
            raise
        if request not in done:
            _drop(request)
            if broken.done():
                raise broken.result()
            raise ToolFailure(TIMEOUT, f"{tool} gave no answer within {timeout:g} s")
        try:
            result = request.result()
        except Exception as exc:  # noqa: BLE001 - whatever the SDK raised
            raise self._call_failure(exc, broken) from None
        return result_text(result, max_bytes)

    def _call_failure(self, exc: Exception, broken: asyncio.Future) -> ToolFailure:
        from mcp.shared.exceptions import MCPError

        reason = _reason(exc)
        if isinstance(exc, MCPError) and "closed" not in reason.lower():
            return ToolFailure(TOOL_ERROR, reason)  # a JSON-RPC error answer
        if isinstance(exc, MCPError):  # the connection closed: the child exited
            failure = ToolFailure(SERVER_ERROR, f"the MCP server {self.name} closed: {reason}")
            self._break(broken, failure)
            return failure
        return ToolFailure(BAD_RESPONSE, f"the MCP server {self.name} answered something "
                                         f"that is not a tool result: {reason}")


def _errlog() -> Any:
    """Where a stdio child's stderr goes: the server's stderr, as a file with a descriptor
    (``sys.stderr`` may have been replaced by one without)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
            return stream
        except (AttributeError, OSError, ValueError):
            continue
    return open(os.devnull, "w")  # noqa: SIM115 - the child's for its life


def _drop(task: asyncio.Future) -> None:
    """Cancel ``task``; its outcome is nobody's."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _reason(exc: BaseException) -> str:
    """An exception in a few words, the first of a group's."""
    while getattr(exc, "exceptions", None):  # an exception group: its first
        exc = exc.exceptions[0]
    text = str(exc) or type(exc).__name__
    return text[:200]


class McpManager:
    """The operator's MCP servers (``--mcp``), owned by the app: started on the loop at
    startup, their tools offered to every session, closed at shutdown."""

    def __init__(self, specs: list[McpServerSpec], *, allow_urls: Sequence[str] = (),
                 max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES, **connection: Any):
        self.connections = {spec.name: McpConnection(spec, **connection) for spec in specs}
        self.max_result_bytes = max_result_bytes
        self.policy = UrlPolicy(allow_urls)  # the URLs a session may name (--mcp-allow-url)
        self.connection_options = connection
        self._starting: asyncio.Task | None = None

    def start_soon(self) -> None:
        """Connect the servers in the background (the app serves meanwhile; a session
        opened before a server is connected is offered the tools listed so far)."""
        self._starting = asyncio.ensure_future(self.start())

    async def start(self) -> None:
        """Connect every server at once; one that fails is logged and restarted later."""
        async def start_one(conn: McpConnection) -> None:
            try:
                await conn.connect()
            except ToolFailure as failure:
                logger.error("%s", failure.message)
                conn.starts = max(conn.starts, 1)  # allow its restarts
                conn._break(conn._broken or asyncio.get_running_loop().create_future(), failure)

        await asyncio.gather(*(start_one(c) for c in self.connections.values()))

    async def close(self) -> None:
        """Stop every server (children reaped), a start still under way first."""
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.wait({self._starting})
        await asyncio.gather(*(c.close() for c in self.connections.values()))

    def tools(self) -> list[McpTool]:
        """The tools listed now, as the model is offered them (a tool whose schema the
        model cannot take is left out, logged)."""
        offered: list[McpTool] = []
        seen: set[str] = set()
        for conn in self.connections.values():
            for name, listed in conn.tools.items():
                tool = offer(conn.spec.name, name, listed, conn.spec.ack_messages,
                             conn.spec.tool_timeouts.get(name, conn.spec.timeout))
                if tool is None or name in seen:
                    continue
                seen.add(name)
                offered.append(tool)
        return offered

    async def call(self, tool: McpTool, arguments: dict[str, Any]) -> str:
        conn = self.connections.get(tool.server)
        if conn is None:
            raise ToolFailure(UNKNOWN_TOOL, f"no MCP server {tool.server!r}")
        return await conn.call(tool.name, arguments, tool.timeout, self.max_result_bytes)


def offer(server: str, name: str, listed: dict[str, Any], acks: tuple[str, ...],
          timeout: float, **kinds: bool) -> McpTool | None:
    """One listed tool as a function tool the model can take, or ``None`` (logged)."""
    spec = {"name": name, "description": ascii_text(listed.get("description") or "")[:1024],
            "parameters": listed.get("inputSchema") or {"type": "object", "properties": {}}}
    if acks:
        spec["ack_messages"] = list(acks)
    try:
        parse_tool(spec, 0)
    except ToolError as exc:
        logger.warning("MCP tool %s.%s is not offered: %s", server, name, exc)
        return None
    return McpTool(server, name, spec, timeout, **kinds)
