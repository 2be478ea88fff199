"""A call the server runs (an MCP tool), as GA's ``mcp_call`` item and its events.

OpenAI's Realtime GA runs MCP tools itself and shows each call as an ``mcp_call``
output item of the response: ``response.output_item.added`` and
``conversation.item.added``, ``response.mcp_call_arguments.delta`` / ``.done``,
``response.mcp_call.in_progress``; when the call ends ``response.mcp_call.completed``
(the item's ``output``) or ``response.mcp_call.failed`` (its ``error``, a
``tool_execution_error`` whose message starts with the failure's type), then
``conversation.item.done`` and ``response.output_item.done``. The response does not
end at the call (the client runs nothing): the model speaks on once the result is in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...mcp.events import ServerToolCall, ToolOutput
from ...wire import ErrorCode, new_id
from .audio import OutputAudio
from .config import error_event
from .records import Out

if TYPE_CHECKING:  # the responses call these modules: for the type only
    from .responses import GAResponses


def mcp_call(book: GAResponses, event: ServerToolCall, out: Out) -> None:
    """The call's item and its arguments, in the open response (one opens if none)."""
    if book.response is None:
        book.start_response(out, int(event.frame_index))
    response = book.response
    book.announce(out)
    if response.message is not None:
        book.close_message(out)  # its audio's resampler flushed: the speech after the
        response.audio = OutputAudio(book.config.output_format, book.model_rate)  # call, anew
    item_id, index = new_id("mcp"), len(response.output)
    item = {"id": item_id, "type": "mcp_call", "server_label": event.server_label,
            "name": event.name, "arguments": ""}
    if event.approval_request_id:  # its mcp_approval_request came first
        item["approval_request_id"] = event.approval_request_id
    where = {"response_id": response.id, "item_id": item_id, "output_index": index}
    out.append({"type": "response.output_item.added", "response_id": response.id,
                "output_index": index, "item": item})
    book.add_item(item, out, "conversation.item.added")
    out.append({"type": "response.mcp_call_arguments.delta", **where, "delta": event.arguments})
    out.append({"type": "response.mcp_call_arguments.done", **where,
                "arguments": event.arguments})
    out.append({"type": "response.mcp_call.in_progress", "item_id": item_id,
                "output_index": index})
    running = {**item, "arguments": event.arguments}
    response.output.append(running)
    book.mcp_calls[event.call_id] = (response.id, index, running)


def mcp_output(book: GAResponses, event: ToolOutput, out: Out) -> None:
    """The call ended: completed with its output, or failed with its error (a call the
    client runs, its timeout: a ``tool_call_failed`` error naming the call)."""
    entry = book.mcp_calls.pop(event.call_id, None)
    if entry is None:
        if event.failure and not event.server_label:
            out.append(error_event(ErrorCode.TOOL_CALL_FAILED,
                                   f"{event.failure}: {event.message}",
                                   param=next((ga for ga, runtime in book.calls.items()
                                               if runtime == event.call_id), event.call_id)))
        return
    response_id, index, item = entry
    done: dict[str, Any] = dict(item)
    if event.failure:
        done["error"] = {"type": "tool_execution_error",
                         "message": f"{event.failure}: {event.message}"}
        kind = "response.mcp_call.failed"
    else:
        done["output"] = event.output
        kind = "response.mcp_call.completed"
    item.update(done)  # the response's output holds the item as it ends
    out.append({"type": kind, "item_id": item["id"], "output_index": index})
    book.add_item(done, out, "conversation.item.done")
    out.append({"type": "response.output_item.done", "response_id": response_id,
                "output_index": index, "item": done})
