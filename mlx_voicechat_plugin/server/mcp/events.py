"""The events of a call the server runs, as the dialects translate them.

:class:`ServerToolCall` is the runtime's :class:`~...runtime.events.ToolCall` for a
tool the server runs (an MCP tool): a dialect that knows no better shows it as any
call; the GA dialect shows it as an ``mcp_call`` item. :class:`ToolOutput` is its
end: the result the model hears, or a typed failure (``failure`` set, ``output``
the ``{"error": ...}`` text the model hears).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...runtime.events import ToolCall


@dataclass(frozen=True)
class ServerToolCall(ToolCall):
    """A call of a tool the server runs (its server's label; the approval request it
    waits on, if it needs one: announced before the call)."""

    server_label: str = ""
    approval_request_id: str = ""


@dataclass(frozen=True)
class ToolOutput:
    """A server-run call ended: ``output`` goes to the model; ``failure`` is its type if it
    failed (:data:`~...runtime.tool_failures.FAILURE_TYPES`), ``message`` why."""

    frame_index: int
    call_id: str
    name: str
    server_label: str
    arguments: str
    output: str
    failure: str | None = None
    message: str = ""


@dataclass(frozen=True)
class ApprovalRequest:
    """A server-run call waits for the client's approval (``approval_id``)."""

    frame_index: int
    approval_id: str
    call_id: str
    name: str
    server_label: str
    arguments: str
