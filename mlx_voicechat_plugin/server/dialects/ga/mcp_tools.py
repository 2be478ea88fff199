"""GA's ``{"type": "mcp"}`` session tools: parsed, listed (``mcp_list_tools`` items and
events) and approved (``mcp_approval_request`` / ``mcp_approval_response`` items).

``{"type": "mcp", "server_label", "server_url", "headers", "allowed_tools",
"require_approval", "server_description"}``: ``server_url`` only (no
``connector_id``), reached only where the operator allows it
(:mod:`...mcp.session_servers`); ``allowed_tools`` a list of names or
``{"tool_names": [...]}``; ``require_approval`` ``"always"`` (the default, as
OpenAI's), ``"never"`` or ``{"always": {"tool_names"}, "never": {"tool_names"}}``.
A listing is ``conversation.item.added`` (an ``mcp_list_tools`` item),
``mcp_list_tools.in_progress``, then ``mcp_list_tools.completed`` with
``conversation.item.done`` (its tools), or ``mcp_list_tools.failed`` and an
``error`` saying why. ``headers`` are never echoed or logged.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ...mcp.events import ApprovalRequest
from ...mcp.session_servers import APPROVALS, SessionMcpServer
from ...wire import init_failed, invalid, new_id
from .config import is_mcp
from .records import Out

if TYPE_CHECKING:  # the responses call these modules: for the type only
    from .responses import GAResponses

_LABEL = re.compile(r"[A-Za-z0-9_\-]{1,64}")
_KEYS = frozenset({"type", "server_label", "server_url", "headers", "allowed_tools",
                   "require_approval", "server_description", "authorization"})


def _names(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, dict):
        value = value.get("tool_names", [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise init_failed(f"{where} must be a list of tool names or {{\"tool_names\": [...]}}")
    return tuple(value)


def parse_mcp_tool(tool: dict[str, Any], index: int) -> SessionMcpServer:
    """One ``mcp`` session tool, each mistake naming its field."""
    where = f"session.tools[{index}]"
    unknown = sorted(set(tool) - _KEYS)
    if unknown:
        raise init_failed(f"{where}.{unknown[0]} is not supported for an mcp tool")
    label = tool.get("server_label")
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise init_failed(f"{where}.server_label must match {_LABEL.pattern}")
    url = tool.get("server_url")
    if not isinstance(url, str) or not url:
        raise init_failed(f"{where}.server_url is required (connector_id is not supported)")
    headers = tool.get("headers") or {}
    if "authorization" in tool and isinstance(tool["authorization"], str):
        headers = {**headers, "Authorization": f"Bearer {tool['authorization']}"}
    if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise init_failed(f"{where}.headers must be an object of string values")
    allowed = tool.get("allowed_tools")
    allowed = None if allowed is None else _names(allowed, f"{where}.allowed_tools")
    approval = tool.get("require_approval", "always")
    always: tuple[str, ...] = ()
    never: tuple[str, ...] = ()
    if isinstance(approval, dict):
        unknown = set(approval) - {"always", "never"}
        if unknown:
            raise init_failed(f"{where}.require_approval takes 'always' and 'never' filters")
        always = _names(approval.get("always") or [], f"{where}.require_approval.always")
        never = _names(approval.get("never") or [], f"{where}.require_approval.never")
        approval = "always"  # a tool in neither filter needs approval
    elif approval not in APPROVALS:
        raise init_failed(f"{where}.require_approval must be 'always', 'never' or a filter")
    return SessionMcpServer(label, url, dict(headers), allowed, approval,
                            frozenset(always), frozenset(never))


def parse_mcp_tools(tools: list[Any]) -> list[SessionMcpServer]:
    servers = [parse_mcp_tool(t, i) for i, t in enumerate(tools) if is_mcp(t)]
    labels = [s.label for s in servers]
    if len(set(labels)) != len(labels):
        raise init_failed("session.tools: two mcp tools share a server_label")
    return servers


# --- events -------------------------------------------------------------------------


def listing_started(book: GAResponses, server: SessionMcpServer) -> tuple[str, Out]:
    item_id = new_id("mcpl")
    item = {"id": item_id, "type": "mcp_list_tools", "server_label": server.label,
            "tools": []}
    out: Out = []
    book.add_item(item, out, "conversation.item.added")
    out.append({"type": "mcp_list_tools.in_progress", "item_id": item_id})
    return item_id, out


def listing_done(book: GAResponses, item_id: str, server: SessionMcpServer,
                 tools: dict[str, dict[str, Any]]) -> Out:
    item = {"id": item_id, "type": "mcp_list_tools", "server_label": server.label,
            "tools": [{"name": name, "description": t.get("description") or "",
                       "input_schema": t.get("inputSchema") or {}}
                      for name, t in tools.items()]}
    out: Out = [{"type": "mcp_list_tools.completed", "item_id": item_id}]
    book.add_item(item, out, "conversation.item.done")
    return out


def listing_failed(item_id: str, error: dict[str, Any]) -> Out:
    return [{"type": "mcp_list_tools.failed", "item_id": item_id}, error]


def approval_request(book: GAResponses, event: ApprovalRequest, out: Out) -> None:
    item = {"id": event.approval_id, "type": "mcp_approval_request",
            "server_label": event.server_label, "name": event.name,
            "arguments": event.arguments}
    book.add_item(item, out, "conversation.item.added")
    book.add_item(item, out, "conversation.item.done")


def approval_response(item: dict[str, Any]) -> tuple[dict[str, Any], str, bool]:
    """A client's ``mcp_approval_response`` item: as echoed, its request id, approve."""
    request_id, approve = item.get("approval_request_id"), item.get("approve")
    if not isinstance(request_id, str) or not isinstance(approve, bool):
        raise invalid("mcp_approval_response needs approval_request_id (a string) and "
                          "approve (a boolean)")
    echoed = {"id": item["id"] if isinstance(item.get("id"), str) else new_id("item"),
              "type": "mcp_approval_response", "approval_request_id": request_id,
              "approve": approve}
    if isinstance(item.get("reason"), str):
        echoed["reason"] = item["reason"]
    return echoed, request_id, approve
