"""The tools one session's calls run on the server: offered at open, run, fed back, cancelled.

:class:`SessionTools` belongs to one :class:`~..session.session.Session`. At each engine open
it adds the tools the server runs (the operator's MCP tools; a name the session
defines itself stays the session's) to the session's own (:meth:`offer`). Each
frame's events pass through :meth:`observe` before the dialect translates them: a
call of a server-run tool becomes a :class:`~.events.ServerToolCall` and runs in
a task of the session (:meth:`~..session.session.Session.spawn`); its end is a
:class:`~.events.ToolOutput` the dialect shows, and its output (the result, or
the typed failure) goes to the model as a tool result. A cancelled response
(barge-in, ``response.cancel``) cancels the calls in flight (the model hears
``cancelled``); a close cancels them with the session's tasks; a result that
comes after its call was cancelled, or after the engine stream it belonged to was
reopened, is dropped and logged. Calls are this session's alone: no other session
sees them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...runtime.events import Cancelled, ToolCall
from ...runtime.options import ConversationOptions
from ...runtime.tool_failures import CANCELLED, DENIED, SERVER_ERROR, ToolFailure
from ..wire import new_id
from .config import DEFAULT_ACK, McpServerSpec
from .events import ApprovalRequest, ServerToolCall, ToolOutput
from .manager import McpConnection, McpManager, McpTool, offer
from .session_servers import SessionMcpServer, UrlRefused

if TYPE_CHECKING:
    from ..session.session import Session

logger = logging.getLogger(__name__)


class SessionTools:
    """The server-run tools of one session and its calls in flight."""

    def __init__(self, session: "Session", manager: McpManager):
        self.session = session
        self.manager = manager
        self.offered: dict[str, McpTool] = {}  # name -> tool, as offered at the last open
        self.inflight: dict[str, tuple[asyncio.Task, ServerToolCall]] = {}  # runtime call id
        self.generation = 0  # engine opens; a result of an earlier one is dropped
        # The MCP servers the session named (GA's mcp tools): label -> server, connection,
        # the tools it may call there.
        self.own: dict[str, tuple[SessionMcpServer, McpConnection, dict[str, Any]]] = {}
        self.approvals: dict[str, asyncio.Future] = {}  # approval id -> the client's answer

    # --- at open ---------------------------------------------------------------------

    def offer(self, options: Any) -> Any:
        """``options`` with the server-run tools beside the session's own (a conversation's;
        other streams carry no tools)."""
        self.cancel_all("the session was opened again")
        self.generation += 1
        if not isinstance(options, ConversationOptions):
            self.offered = {}
            return options
        taken = {t.get("name") if "function" not in t else t["function"].get("name")
                 for t in options.tools or [] if isinstance(t, dict)}
        self.offered = {}
        for tool in [*self._own_tools(), *self.manager.tools()]:  # the session's servers first
            if tool.name not in taken:
                taken.add(tool.name)
                self.offered[tool.name] = tool
        if not self.offered:
            return options
        return replace(options, tools=[*(options.tools or []),
                                       *(t.spec for t in self.offered.values())])

    def _own_tools(self) -> list[McpTool]:
        tools = []
        for server, conn, listed in self.own.values():
            for name, spec in listed.items():
                tool = offer(server.label, name, spec, DEFAULT_ACK, server.timeout,
                             approval=server.needs_approval(name), owned=True)
                if tool is not None:
                    tools.append(tool)
        return tools

    # --- the session's own servers (GA's mcp tools) ------------------------------------

    async def connect_own(self, server: SessionMcpServer) -> dict[str, Any]:
        """Connect a server the session named, if the operator allows its URL; the tools
        the session may call there (``allowed_tools``). :class:`UrlRefused` or
        :class:`ToolFailure` if not."""
        if not self.manager.policy:
            raise UrlRefused("this server lets no session name an MCP server "
                             "(the operator's --mcp-allow-url)")
        await self.manager.policy.check(server.url)
        spec = McpServerSpec(name=server.label, url=server.url, headers=server.headers,
                             timeout=server.timeout)
        conn = McpConnection(spec, restart=False, **self.manager.connection_options)
        await conn.connect()
        listed = {name: tool for name, tool in conn.tools.items()
                  if server.allowed_tools is None or name in server.allowed_tools}
        self.own[server.label] = (server, conn, listed)
        return listed

    async def close_own(self) -> None:
        """Disconnect the servers the session named."""
        own, self.own = self.own, {}
        await asyncio.gather(*(conn.close() for _, conn, _ in own.values()))

    async def close(self) -> None:
        """The session ends: its calls cancelled, its own servers disconnected."""
        self.cancel_all("the session closed")
        await self.close_own()

    def approve(self, approval_id: str, approve: bool) -> None:
        """The client's answer to an approval request; ``ValueError`` if none waits."""
        waiting = self.approvals.get(approval_id)
        if waiting is None or waiting.done():
            raise ValueError(f"no approval request {approval_id!r} is waiting")
        waiting.set_result(approve)

    async def _approval(self, call: ServerToolCall, tool: McpTool) -> None:
        """Wait for the client's approval of ``call`` (its request was announced with
        it; within the tool's timeout), else a ``denied`` failure."""
        waiting = self.approvals[call.approval_request_id]
        try:
            approved = await asyncio.wait_for(waiting, tool.timeout)
        except asyncio.TimeoutError:
            raise ToolFailure(DENIED, f"no approval within {tool.timeout:g} s") from None
        finally:
            self.approvals.pop(call.approval_request_id, None)
        if not approved:
            raise ToolFailure(DENIED, "the user did not approve this call; it was not run")

    def runs(self, call_id: str) -> bool:
        """Whether ``call_id`` is a call the server runs now (not the client's to answer)."""
        return call_id in self.inflight

    # --- each frame --------------------------------------------------------------------

    def observe(self, events: list) -> list:
        """One frame's events, a server-run tool's call started and marked as such; a
        cancelled response cancels the calls in flight."""
        out = []
        for event in events:
            if isinstance(event, Cancelled) and self.inflight:
                self.cancel_all("the response was cancelled", tell=True)
            if type(event) is ToolCall and event.name in self.offered:
                tool = self.offered[event.name]
                approval_id = new_id("mcpr") if tool.approval else ""
                event = ServerToolCall(event.frame_index, event.call_id, event.name,
                                       event.arguments, server_label=tool.server,
                                       approval_request_id=approval_id)
                if approval_id:  # its request first, as OpenAI's: the call names it
                    self.approvals[approval_id] = asyncio.get_running_loop().create_future()
                    out.append(ApprovalRequest(event.frame_index, approval_id, event.call_id,
                                               event.name, event.server_label,
                                               event.arguments))
                self._start(event, tool)
            out.append(event)
        return out

    def _start(self, call: ServerToolCall, tool: McpTool) -> None:
        task = self.session.spawn(self._run(call, tool, self.generation))
        self.inflight[call.call_id] = (task, call)

    async def _run(self, call: ServerToolCall, tool: McpTool, generation: int) -> None:
        try:
            if call.approval_request_id:
                await self._approval(call, tool)
            arguments = json.loads(call.arguments)
            if tool.owned:
                conn = self.own[tool.server][1] if tool.server in self.own else None
                if conn is None:
                    raise ToolFailure(SERVER_ERROR, f"the MCP server {tool.server} was closed")
                output = await conn.call(tool.name, arguments, tool.timeout,
                                         self.manager.max_result_bytes)
            else:
                output = await self.manager.call(tool, arguments)
            failure = None
        except ToolFailure as exc:
            output, failure = exc.output(), exc
        except asyncio.CancelledError:
            logger.info("%s call %s (%s) cancelled", self.session.session_id, call.call_id,
                        call.name)
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must not end the session
            logger.exception("%s call %s (%s) failed", self.session.session_id, call.call_id,
                             call.name)
            failure = ToolFailure(SERVER_ERROR, f"the call failed: {type(exc).__name__}")
            output = failure.output()
        if self.inflight.get(call.call_id, (None,))[0] is not asyncio.current_task() \
                or generation != self.generation or self.session.released:
            logger.info("%s late result of call %s (%s) dropped: the session moved on",
                        self.session.session_id, call.call_id, call.name)
            return
        del self.inflight[call.call_id]
        await self._finish(call, output, failure)

    async def _finish(self, call: ServerToolCall, output: str,
                      failure: ToolFailure | None) -> None:
        """Show the call's end to the client, then give its output to the model."""
        if failure is not None:
            logger.info("%s call %s (%s) failed: %s", self.session.session_id, call.call_id,
                        call.name, failure)
        event = ToolOutput(self.session.frames_seen, call.call_id, call.name, call.server_label,
                           call.arguments, output, failure.type if failure else None,
                           failure.message if failure else "")
        self.session.deliver(self.session.dialect.translate([event]))
        try:
            await self.session.engine.tool_result(self.session.session_id, call.call_id, output)
        except Exception as exc:  # noqa: BLE001 - the stream was closed or reopened meanwhile
            logger.info("%s result of call %s dropped: %s", self.session.session_id,
                        call.call_id, exc)

    # --- cancelling --------------------------------------------------------------------

    def cancel_all(self, reason: str, tell: bool = False) -> None:
        """Cancel the calls in flight; with ``tell``, the client and the model hear
        ``cancelled``."""
        calls, self.inflight = self.inflight, {}
        for task, call in calls.values():
            task.cancel()
            self.approvals.pop(call.approval_request_id, None)
            logger.info("%s call %s (%s) cancelled: %s", self.session.session_id,
                        call.call_id, call.name, reason)
            if tell:
                failure = ToolFailure(CANCELLED, reason)
                self.session.spawn(self._finish(call, failure.output(), failure))
