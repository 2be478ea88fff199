"""Tool calls on the live timeline: parse the function channel, feed results back.

:class:`ToolCallParser` assembles the function channel's cumulative text into
``<TOOLCALL>[...]</TOOLCALL>`` blocks and turns each element into a
:class:`ToolCall` or a :class:`ToolCallInvalid`. :class:`ToolChannel` adds the
call registry and the result queue: a submitted result is tokenized as
``<TOOL_RESPONSE>[...]</TOOL_RESPONSE>`` and forced onto the function channel
one token per frame (``Timeline.listen(force_function=...)``), so each token is
the function channel's previous-token input of the frame after it, while audio
keeps flowing and the text channel stays free.

Where results enter the duplex timeline is not in NeMo's public inference
code (its BFCL function-channel evaluation is single turn); the function
channel is our documented assumption, the one channel that carries tool text.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import deque
from typing import Any, Callable

from .events import ToolCall, ToolCallInvalid, ToolResultInjected
from .quoting import brief
from .timeline import prompt_token_ids
from .tools import (
    DEFAULT_MAX_TOOLS,
    TOOLCALL_END,
    TOOLCALL_START,
    ToolError,
    ToolSet,
    coerce_arguments,
    render_system_prompt,
    render_tool_response,
    schema_errors,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_CALLS_PER_TURN = 4
MAX_CALL_CHARS = 8192


def tool_prompt(
    tokenizer: Any, model: Any, system_prompt: str | None, tools: list[dict] | None,
    max_tools: int = DEFAULT_MAX_TOOLS,
) -> tuple[list[int], ToolSet | None]:
    """Prompt ids with the tool block rendered in, and the validated tools (or ``None``)."""
    if tools is None:
        return prompt_token_ids(tokenizer, model, system_prompt), None
    toolset = ToolSet(tools, max_tools)
    base = model.config.default_system_prompt if system_prompt is None else system_prompt
    rendered = render_system_prompt(base, toolset)
    return prompt_token_ids(tokenizer, model, rendered), toolset


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex


class ToolCallParser:
    """Incremental ``<TOOLCALL>`` parsing over a channel's cumulative text."""

    def __init__(
        self,
        tools: ToolSet,
        *,
        max_calls_per_turn: int = DEFAULT_MAX_CALLS_PER_TURN,
        call_id: Callable[[], str] = new_call_id,
    ):
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        self.tools = tools
        self.max_calls_per_turn = max_calls_per_turn
        self._call_id = call_id
        self._consumed = 0  # characters of the cumulative text already parsed
        self._start: int | None = None  # where an open block's content begins
        self.calls_this_turn = 0

    def new_turn(self) -> None:
        """The user spoke again: the per-turn call budget starts over."""
        self.calls_this_turn = 0

    def feed(self, text: str, frame_index: int) -> list[ToolCall | ToolCallInvalid]:
        """Parse the blocks completed in cumulative ``text``."""
        events: list[ToolCall | ToolCallInvalid] = []
        while True:
            if self._start is None:
                at = text.find(TOOLCALL_START, self._consumed)
                if at < 0:
                    # Keep a tail that could still grow into the start tag.
                    self._consumed = max(self._consumed, len(text) - len(TOOLCALL_START) + 1)
                    return events
                self._start = at + len(TOOLCALL_START)
                self._consumed = self._start
            end = text.find(TOOLCALL_END, self._start)
            if end < 0:
                if len(text) - self._start > MAX_CALL_CHARS:
                    raw = text[self._start :]
                    events.append(self._invalid(frame_index, "unterminated",
                                                f"no {TOOLCALL_END} within {MAX_CALL_CHARS} characters", raw))
                    self._start = None
                    self._consumed = len(text)
                return events
            events += self._parse_block(text[self._start : end], frame_index)
            self._start = None
            self._consumed = end + len(TOOLCALL_END)

    def finish(self, text: str, frame_index: int) -> list[ToolCallInvalid]:
        """The stream ended: an open block is reported as unterminated."""
        if self._start is None:
            return []
        raw = text[self._start :]
        self._start = None
        self._consumed = len(text)
        return [self._invalid(frame_index, "unterminated", f"stream ended before {TOOLCALL_END}", raw)]

    # --- one block -------------------------------------------------------

    def _invalid(self, frame_index: int, reason: str, message: str, raw: str) -> ToolCallInvalid:
        logger.warning("invalid tool call (%s): %s; raw=%r", reason, message, raw[:200])
        return ToolCallInvalid(frame_index, reason, message, raw)

    def _parse_block(self, body: str, frame_index: int) -> list[ToolCall | ToolCallInvalid]:
        text = body.strip()
        # Like NeMo's parser, tolerate a block whose list brackets were dropped.
        candidate = text if text.startswith("[") else "[" + text
        candidate = candidate if candidate.endswith("]") else candidate + "]"
        try:
            items = json.loads(candidate)
        except ValueError as exc:
            return [self._invalid(frame_index, "malformed", f"not JSON: {exc}", body)]
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list):
            return [self._invalid(frame_index, "malformed", "expected a list of calls", body)]
        return [self._parse_call(item, frame_index) for item in items]

    def _parse_call(self, item: Any, frame_index: int) -> ToolCall | ToolCallInvalid:
        raw = json.dumps(item)
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return self._invalid(frame_index, "malformed", "a call needs a string 'name'", raw)
        name = item["name"]
        if name not in self.tools:
            return self._invalid(frame_index, "unknown_tool", f"no tool named {name!r}", raw)
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                return self._invalid(frame_index, "malformed", "arguments are not JSON", raw)
        if not isinstance(arguments, dict):
            return self._invalid(frame_index, "malformed", "arguments must be a JSON object", raw)
        schema = self.tools[name].parameters
        arguments = coerce_arguments(arguments, schema)
        errors = schema_errors(arguments, schema)
        if errors:
            return self._invalid(frame_index, "schema", "; ".join(errors), raw)
        if self.calls_this_turn >= self.max_calls_per_turn:
            return self._invalid(
                frame_index, "limit",
                f"more than {self.max_calls_per_turn} tool calls in one user turn", raw,
            )
        self.calls_this_turn += 1
        return ToolCall(frame_index, self._call_id(), name, json.dumps(arguments))


class ToolChannel:
    """Parsing, the call registry and the forced-token queue of one session."""

    def __init__(self, tools: ToolSet, tokenizer: Any, *, max_calls_per_turn: int = DEFAULT_MAX_CALLS_PER_TURN):
        self.tools = tools
        self.tokenizer = tokenizer
        self.parser = ToolCallParser(tools, max_calls_per_turn=max_calls_per_turn)
        self.pending: dict[str, ToolCall] = {}  # call_id -> call awaiting its result
        self.answered: set[str] = set()
        self._queue: deque[tuple[str, int]] = deque()  # (call_id, token)
        self._injecting: dict[str, list[int]] = {}  # call_id -> [first_frame, count]

    # --- the function channel --------------------------------------------

    def observe(self, text: str, frame_index: int) -> list[ToolCall | ToolCallInvalid]:
        events = self.parser.feed(text, frame_index)
        for event in events:
            if isinstance(event, ToolCall):
                self.pending[event.call_id] = event
        return events

    def finish(self, text: str, frame_index: int) -> list[ToolCallInvalid]:
        return self.parser.finish(text, frame_index)

    # --- results -----------------------------------------------------------

    def submit(self, call_id: str, output: str) -> int:
        """Queue a call's result for injection; returns its token count."""
        if not isinstance(call_id, str):
            raise ToolError(f"call_id must be a string, got {type(call_id).__name__}")
        if call_id in self.answered:
            raise ToolError(f"tool call {brief(call_id)} already has a result")
        if call_id not in self.pending:
            raise ToolError(f"unknown tool call id {brief(call_id)}")
        tokens = self.tokenizer.encode(render_tool_response(output), add_special_tokens=False)
        del self.pending[call_id]
        self.answered.add(call_id)
        self._queue.extend((call_id, int(t)) for t in tokens)
        return len(tokens)

    def next_forced(self) -> int | None:
        """The token to force at the next frame, if a result is being injected."""
        return self._queue[0][1] if self._queue else None

    def forced(self, frame_index: int) -> list[ToolResultInjected]:
        """The frame consumed the queued token; report a result that is complete."""
        call_id, _ = self._queue.popleft()
        entry = self._injecting.setdefault(call_id, [frame_index, 0])
        entry[1] += 1
        if self._queue and self._queue[0][0] == call_id:
            return []
        first, count = self._injecting.pop(call_id)
        return [ToolResultInjected(frame_index, call_id, first, count)]

    @property
    def injecting(self) -> bool:
        return bool(self._queue)
