"""The function channel's calls as GPT-Live Responses delegations, and their results.

A call becomes ``session.delegation.created`` (target ``responses``, with the id of the
Responses response that carries it) and that response's stream, each Responses event in
a ``response.event`` envelope naming the delegation: ``response.created``,
``response.output_item.added`` (a ``function_call`` item),
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``,
``response.completed``. That is the form OpenAI's clients act on: the call's name,
arguments and ``call_id`` arrive as the Responses API carries them, and the client
answers with ``response.item.create`` (a ``function_call_output``) and
``response.create``. A ``client`` delegation carries no task text, so a client could not
run a function from it. The result goes to the model as a tool result
(:meth:`~...session.session.Session.tool_output`); ``response.create`` then ends the delegated
response (the Live model speaks the result itself: there is no backend model here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ....runtime.events import ToolCall
from ...wire import new_id
from .config import LiveError

MAX_DELEGATIONS = 64  # delegations remembered (pending or answered) per session


@dataclass
class Delegated:
    """One delegated call: its ids, and whether its result came."""

    id: str
    response_id: str
    call_id: str
    name: str
    answered: bool = False
    continued: bool = False  # response.create continued it


class Delegations:
    """One session's delegations, keyed by the call id the client answers."""

    def __init__(self, model: str):
        self.model = model  # the Responses model the session's config names
        self.calls: dict[str, Delegated] = {}
        self.sequence = 0

    def _event(self, delegation: Delegated, event: dict[str, Any]) -> dict[str, Any]:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        return {"type": "response.event", "delegation_id": delegation.id, "event": event}

    def _response(self, response_id: str, status: str) -> dict[str, Any]:
        """A lifecycle snapshot: output, tools and instructions cleared, as OpenAI's are."""
        return {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": self.model, "status": status, "output": [], "tools": [],
                "tool_choice": "auto", "parallel_tool_calls": False}

    def delegate(self, call: ToolCall, offset_ms: int) -> list[dict[str, Any]]:
        """A call from the function channel: its delegation and its Responses stream."""
        delegation = Delegated(new_id("deleg"), new_id("resp"), call.call_id, call.name)
        self.calls[call.call_id] = delegation
        while len(self.calls) > MAX_DELEGATIONS:
            del self.calls[next(iter(self.calls))]
        item_id = new_id("fc")
        item = {"id": item_id, "type": "function_call", "call_id": call.call_id,
                "name": call.name, "arguments": "", "status": "in_progress"}
        done = {**item, "arguments": call.arguments, "status": "completed"}
        where = {"item_id": item_id, "output_index": 0}
        response = delegation.response_id
        return [
            {"type": "session.delegation.created", "offset_ms": offset_ms,
             "delegation": {"id": delegation.id, "type": "delegation", "target": "responses",
                            "response_id": response}},
            self._event(delegation, {"type": "response.created",
                                     "response": self._response(response, "in_progress")}),
            self._event(delegation, {"type": "response.output_item.added", "output_index": 0,
                                     "item": item}),
            self._event(delegation, {"type": "response.function_call_arguments.delta",
                                     **where, "delta": call.arguments}),
            self._event(delegation, {"type": "response.function_call_arguments.done",
                                     **where, "name": call.name,
                                     "arguments": call.arguments}),
            self._event(delegation, {"type": "response.output_item.done", "output_index": 0,
                                     "item": done}),
            self._event(delegation, {"type": "response.completed",
                                     "response": self._response(response, "completed")}),
        ]

    def result_for(self, call_id: Any) -> Delegated:
        """The delegation a ``function_call_output`` answers (``invalid_value`` when none
        waits for it)."""
        where = "item.call_id"
        if not isinstance(call_id, str) or not call_id:
            raise LiveError("missing_required_parameter",
                            f"Missing required parameter: '{where}'.", where)
        delegation = self.calls.get(call_id)
        if delegation is None:
            raise LiveError("invalid_value", f"Invalid value for '{where}': no delegated "
                            f"function call with call_id {call_id[:64]!r} exists.", where)
        if delegation.answered:
            raise LiveError("invalid_value", f"Invalid value for '{where}': the call "
                            f"{call_id[:64]!r} already has its result.", where)
        return delegation

    def answered(self, delegation: Delegated) -> None:
        delegation.answered = True

    def continue_waiting(self) -> list[dict[str, Any]]:
        """``response.create``: each delegated response whose result came and that was not
        continued yet ends (a new response of the delegation, completed: the Live model
        speaks the result); ``[]`` when none waits."""
        out: list[dict[str, Any]] = []
        for delegation in self.calls.values():
            if delegation.answered and not delegation.continued:
                delegation.continued = True
                response = new_id("resp")
                out.append(self._event(delegation, {
                    "type": "response.created", "response": self._response(response,
                                                                           "in_progress")}))
                out.append(self._event(delegation, {
                    "type": "response.completed", "response": self._response(response,
                                                                             "completed")}))
        return out
