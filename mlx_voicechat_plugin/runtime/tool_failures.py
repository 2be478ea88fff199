"""A tool call that did not give a result: one typed failure the model hears.

Whoever runs a call (the server's MCP manager, a client) ends it with a result
or a :class:`ToolFailure`. A failure reaches the model as a tool result like any
other (:meth:`ToolFailure.output`, a JSON object ``{"error": {"type", "message"}}``
inside ``<TOOL_RESPONSE>``), so the model can tell the user and the session goes
on; the client sees the same ``type`` in its dialect's failure event.
:func:`bounded_output` is the one gate every result passes: ASCII (the tool text
the checkpoint was trained on) and at most ``max_bytes``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..quoting import cut

# A result is forced onto the function channel one token per 80 ms frame: 4 KiB of
# JSON is some 1000 tokens, over a minute of the model's time.
DEFAULT_MAX_RESULT_BYTES = 4096
# How long a server-run call may take before it fails as ``timeout``.
DEFAULT_TOOL_TIMEOUT = 30.0
MESSAGE_CHARS = 300

# The failure types, as the model and the client see them.
UNKNOWN_TOOL = "unknown_tool"  # no such tool (or not offered to this session)
INVALID_ARGUMENTS = "invalid_arguments"  # not valid under the tool's JSON Schema
TIMEOUT = "timeout"  # no answer within the tool's timeout
SERVER_ERROR = "server_error"  # the tool's server crashed, closed or cannot be reached
BAD_RESPONSE = "bad_response"  # the server answered something that is not a tool result
TOO_LARGE = "too_large"  # the result is over the byte bound
TOOL_ERROR = "tool_error"  # the tool ran and reported an error itself
CANCELLED = "cancelled"  # the response was cancelled (barge-in) or the session closed
DENIED = "denied"  # the client refused its approval
FAILURE_TYPES = (UNKNOWN_TOOL, INVALID_ARGUMENTS, TIMEOUT, SERVER_ERROR, BAD_RESPONSE,
                 TOO_LARGE, TOOL_ERROR, CANCELLED, DENIED)


@dataclass(frozen=True)
class ToolFailure(Exception):
    """A call that ended without a result: ``type`` (one of :data:`FAILURE_TYPES`), why."""

    type: str
    message: str

    def __post_init__(self) -> None:
        if self.type not in FAILURE_TYPES:
            raise ValueError(f"unknown tool failure type {self.type!r}")
        object.__setattr__(self, "message", cut(str(self.message), MESSAGE_CHARS))

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"

    def output(self) -> str:
        """The tool result the model hears: ``{"error": {"type": ..., "message": ...}}``."""
        return json.dumps({"error": {"type": self.type, "message": self.message}})


def bounded_output(text: str, max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> str:
    """``text`` as a tool result: ASCII (other characters JSON-escaped), at most
    ``max_bytes``, else a :data:`TOO_LARGE` failure."""
    if not isinstance(text, str):
        raise ToolFailure(BAD_RESPONSE, f"a result must be text, got {type(text).__name__}")
    if len(text) > max_bytes:  # at least as many UTF-8 bytes: no need to encode it all
        raise ToolFailure(TOO_LARGE, f"the result has over {max_bytes} bytes "
                                     f"({len(text)} characters); the limit is {max_bytes}")
    if not text.isascii():
        try:
            text = json.dumps(json.loads(text))  # JSON: its strings escaped
        except ValueError:
            text = json.dumps(text)  # plain text: one escaped JSON string
    if len(text) > max_bytes:
        raise ToolFailure(TOO_LARGE, f"the result has {len(text)} bytes once escaped; "
                                     f"the limit is {max_bytes}")
    return text
