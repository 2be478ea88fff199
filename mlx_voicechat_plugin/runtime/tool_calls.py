"""Tool calls on the live timeline: parse the function channel, feed results back.

:class:`ToolChannel` is the cursor over the function channel's cumulative
text: it finds each completed ``<TOOLCALL>[...]</TOOLCALL>`` block, has
:func:`~.tools.parse_call_block` parse it, and turns each element into a
:class:`ToolCall` or a :class:`ToolCallInvalid` within the per-turn budget.
It keeps the call registry and the result queue too: a submitted
result is tokenized as
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
from typing import Any

from .events import ToolCall, ToolCallInvalid, ToolResultInjected
from ..quoting import brief
from .tools import (
    TOOLCALL_END,
    TOOLCALL_START,
    CallError,
    ToolError,
    ToolSet,
    parse_call_block,
    render_tool_response,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_CALLS_PER_TURN = 4
MAX_CALL_CHARS = 8192
# The books of a session of any length: calls awaiting a result, and answered
# call ids (a repeated result is refused as such), the oldest forgotten first.
MAX_PENDING_CALLS = 256
MAX_ANSWERED_CALLS = 1024


class ToolChannel:
    """One session's tool calls: the cursor over the function channel's cumulative text,
    the call registry and the forced-token queue of results."""

    def __init__(self, tools: ToolSet, tokenizer: Any, *,
                 max_calls_per_turn: int = DEFAULT_MAX_CALLS_PER_TURN):
        self.tools = tools
        self.tokenizer = tokenizer
        self.max_calls_per_turn = max_calls_per_turn
        self._consumed = 0  # characters of the cumulative text already parsed
        self._start: int | None = None  # where an open block's content begins
        self._dropped = 0  # characters the text has lost off its front (a bounded channel)
        self.calls_this_turn = 0
        self.pending: dict[str, ToolCall] = {}  # call_id -> call awaiting its result
        self.answered: dict[str, None] = {}  # answered call ids, oldest first
        self._queue: deque[tuple[str, int]] = deque()  # (call_id, token)
        self._injecting: dict[str, list[int]] = {}  # call_id -> [first_frame, count]

    def new_turn(self) -> None:
        """The user spoke again: the per-turn call budget starts over."""
        self.calls_this_turn = 0

    # --- the function channel --------------------------------------------

    def observe(self, text: str, frame_index: int, dropped: int = 0
                ) -> list[ToolCall | ToolCallInvalid]:
        """Parse the blocks completed in cumulative ``text`` (which has lost ``dropped``
        characters off its front so far: a bounded channel, ``TokenText.dropped``)."""
        shift, self._dropped = dropped - self._dropped, dropped
        if shift:
            self._consumed = max(self._consumed - shift, 0)
            if self._start is not None:
                self._start = max(self._start - shift, 0)
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
                    events.append(self._unterminated(text, frame_index, f"no {TOOLCALL_END} "
                                                     f"within {MAX_CALL_CHARS} characters"))
                return events
            events += self._parse_block(text[self._start : end], frame_index)
            self._start = None
            self._consumed = end + len(TOOLCALL_END)

    def finish(self, text: str, frame_index: int) -> list[ToolCallInvalid]:
        """The stream ended: an open block is reported as unterminated."""
        if self._start is None:
            return []
        return [self._unterminated(text, frame_index, f"stream ended before {TOOLCALL_END}")]

    def _unterminated(self, text: str, frame_index: int, message: str) -> ToolCallInvalid:
        """The open block, given up: everything up to the end of ``text`` is consumed."""
        raw = text[self._start :]
        self._start = None
        self._consumed = len(text)
        return self._invalid(frame_index, "unterminated", message, raw)

    def _invalid(self, frame_index: int, reason: str, message: str, raw: str) -> ToolCallInvalid:
        logger.warning("invalid tool call (%s): %s; raw=%r", reason, message, raw[:200])
        return ToolCallInvalid(frame_index, reason, message, raw)

    def _parse_block(self, body: str, frame_index: int) -> list[ToolCall | ToolCallInvalid]:
        """The block's calls, within this turn's budget; the valid ones await a result."""
        events: list[ToolCall | ToolCallInvalid] = []
        for call in parse_call_block(body, self.tools):
            if isinstance(call, CallError):
                events.append(self._invalid(frame_index, call.reason, call.message, call.raw))
            elif self.calls_this_turn >= self.max_calls_per_turn:
                events.append(self._invalid(
                    frame_index, "limit",
                    f"more than {self.max_calls_per_turn} tool calls in one user turn", call.raw,
                ))
            else:
                self.calls_this_turn += 1
                event = ToolCall(frame_index, "call_" + uuid.uuid4().hex, call.name,
                                 json.dumps(call.arguments))
                self.pending[event.call_id] = event
                _forget_oldest(self.pending, MAX_PENDING_CALLS)
                events.append(event)
        return events

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
        self.answered[call_id] = None
        _forget_oldest(self.answered, MAX_ANSWERED_CALLS)
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


def _forget_oldest(book: dict, most: int) -> None:
    """Drop the oldest entries of an insertion-ordered ``book`` past ``most``."""
    while len(book) > most:
        del book[next(iter(book))]
