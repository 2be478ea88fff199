"""The calls a session's client runs: each answered within its timeout and the result bound.

A call of a function tool the session defined (not one the server runs) waits for
the client's ``function_call_output``. :class:`ClientCalls` starts its clock when
the call reaches the session (``--tool-timeout``, default
:data:`~...runtime.tool_failures.DEFAULT_TOOL_TIMEOUT`, as an MCP server's
``timeout``); when no output came by then, the model hears a ``timeout``
:class:`~...runtime.tool_failures.ToolFailure` and the client sees its dialect's
failure (a :class:`~..mcp.events.ToolOutput` with no server), and an output that
comes later is dropped, logged and answered with an error naming the call. An
output passes the gate a server-run result passes
(:func:`~...runtime.tool_failures.bounded_output`): one over the bound reaches the
model as a ``too_large`` failure and the client is told.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

from ...runtime.events import ToolCall
from ...runtime.tool_failures import TIMEOUT, ToolFailure, bounded_output
from ..mcp.events import ToolOutput
from ..wire import ErrorCode, ProtocolError

if TYPE_CHECKING:
    from .session import Session

logger = logging.getLogger(__name__)

EXPIRED_KEPT = 256  # timed-out call ids remembered, to name a late output as such


class ClientCalls:
    """The client-run calls of one session awaiting their output, each on its clock."""

    def __init__(self, session: "Session", timeout: float):
        self.session = session
        self.timeout = timeout
        self.waiting: dict[str, asyncio.Task] = {}  # runtime call id -> its timer
        self.expired: deque[str] = deque(maxlen=EXPIRED_KEPT)

    def observe(self, events: list) -> None:
        """Start the clock of each client-run call among one frame's events."""
        for event in events:
            if type(event) is ToolCall:  # a server-run call is a ServerToolCall
                self.waiting[event.call_id] = self.session.spawn(self._expire(event))

    def forget(self) -> None:
        """The engine stream is reopened: its calls wait no more."""
        waiting, self.waiting = self.waiting, {}
        for timer in waiting.values():
            timer.cancel()

    async def _expire(self, call: ToolCall) -> None:
        await asyncio.sleep(self.timeout)
        self.waiting.pop(call.call_id, None)
        self.expired.append(call.call_id)
        failure = ToolFailure(TIMEOUT, f"the client sent no output for {call.name} "
                                       f"within {self.timeout:g} s")
        logger.info("%s call %s (%s) failed: %s", self.session.session_id, call.call_id,
                    call.name, failure)
        self.session.deliver(self.session.dialect.translate([ToolOutput(
            self.session.frames_seen, call.call_id, call.name, "", call.arguments,
            failure.output(), failure.type, failure.message)]))
        try:
            await self.session.engine.tool_result(self.session.session_id, call.call_id,
                                                  failure.output())
        except Exception as exc:  # noqa: BLE001 - the stream was closed or reopened meanwhile
            logger.info("%s timeout of call %s dropped: %s", self.session.session_id,
                        call.call_id, exc)

    def answer(self, call_id: str, output: str, max_bytes: int) -> tuple[str, ToolFailure | None]:
        """The output the model hears for the client's answer to ``call_id`` (its clock
        stopped), and the failure if it is one; a late answer is a ``ProtocolError``."""
        if call_id in self.expired:
            logger.info("%s late output of call %s dropped: it timed out",
                        self.session.session_id, call_id)
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"tool call {call_id} timed out after {self.timeout:g} s; "
                                "its function_call_output was dropped")
        timer = self.waiting.pop(call_id, None)
        if timer is not None:
            timer.cancel()
        try:
            return bounded_output(output, max_bytes), None
        except ToolFailure as exc:
            return exc.output(), exc
