"""What every dialect's wire shares: error and close codes, ids, JSON limits, PCM16 payloads.

No dialect's messages live here (see :mod:`.dialects`): a client frame is
checked as JSON here (:func:`load_object`), then read by its dialect; server
events are the dialect's dicts, stamped with an ``event_id`` and encoded by
:func:`dumps`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..quoting import cut
from ..runtime.audio import to_pcm16

PCM16_FULL_SCALE = 32768.0  # input decode: int16 / 32768
PCM16_OUTPUT_SCALE = 32767.0  # output encode: round(clip(x) * 32767)
ID_HEX_CHARS = 16
MAX_JSON_DEPTH = 32  # nesting of objects and arrays a client message may have
# Values (objects, arrays, strings, numbers, ...) a client message may hold: a tool
# schema or a chat history's items hold hundreds; a million empty objects fit in 1 MiB.
MAX_JSON_VALUES = 20_000
# A client message longer than this is parsed, and what it makes written out, in a
# worker thread, off the event loop: the other sessions' events go on meanwhile.
OFF_LOOP_CHARS = 64 * 1024
# A JSON string (quotes, escapes), to count the commas between values.
JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
MAX_ERROR_CHARS = 240  # an error message (client values inside it included) is cut to this


class ErrorCode:
    INVALID_REQUEST = "invalid_request"
    SERVER_BUSY = "server_busy"
    SESSION_INITIALIZATION_FAILED = "session_initialization_failed"
    INFERENCE_ERROR = "inference_error"
    TOOLS_NOT_SET = "tools_not_set"
    TOOL_CALL_INVALID = "tool_call_invalid"
    TOOL_CALL_FAILED = "tool_call_failed"  # a call the server ran ended without a result


class CloseCode:
    NORMAL = 1000
    GOING_AWAY = 1001  # the server is stopping (:mod:`.drain`)
    POLICY_VIOLATION = 1008
    TRY_AGAIN_LATER = 1013


class ProtocolError(Exception):
    """A client mistake (or a failed request), answered with an ``error`` event of ``code``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_REQUEST, message)


def init_failed(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.SESSION_INITIALIZATION_FAILED, message)


def inference_error(exc: BaseException) -> ProtocolError:
    """An engine failure as the client's ``inference_error``."""
    return ProtocolError(ErrorCode.INFERENCE_ERROR, str(exc) or type(exc).__name__)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(ID_HEX_CHARS // 2)}"


def new_session_id() -> str:
    return new_id("sess")


# --- client frames ---------------------------------------------------------


def json_shape(value: Any) -> tuple[int, int]:
    """``(depth, values)`` of parsed JSON: its nesting (a scalar is 0) and how many values
    it holds, counted a level at a time without recursion; the count stops once past
    :data:`MAX_JSON_DEPTH` or :data:`MAX_JSON_VALUES`."""
    level, depth, values = [value], 0, 1
    while True:
        level = [item for item in level if isinstance(item, (dict, list))]
        if not level or depth > MAX_JSON_DEPTH or values > MAX_JSON_VALUES:
            return depth, values
        depth += 1
        children: list[Any] = []
        for item in level:
            children.extend(item.values() if isinstance(item, dict) else item)
        values += len(children)
        level = children


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    return json_shape(value)[0]


def more_values_than_allowed(text: str) -> bool:
    """Whether JSON ``text`` holds more than :data:`MAX_JSON_VALUES` values, told from its
    commas outside strings, before it is parsed.

    A container of ``n`` values has ``n - 1`` commas between them, so a document holds at
    least its commas plus one values (:func:`json_shape`'s count): over the bound here is
    over it there, and the commas are counted without the parse's cost.
    """
    if text.count(",") < MAX_JSON_VALUES:
        return False
    return JSON_STRING.sub("", text).count(",") + 1 > MAX_JSON_VALUES


def too_many_values() -> ProtocolError:
    """The ``invalid_request`` for a message past :data:`MAX_JSON_VALUES`."""
    return invalid(f"message holds more than {MAX_JSON_VALUES} JSON values (objects, "
                   "arrays, strings, numbers)")


def load_object(text: str) -> dict[str, Any]:
    """One text frame as a JSON object (``invalid_request`` when malformed, too deep, or
    holding more than :data:`MAX_JSON_VALUES` values: what the server does with a message
    then costs what its bytes say, not a million empty objects' worth)."""
    if more_values_than_allowed(text):
        raise too_many_values()
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):  # the decoder recurses once per nesting level
        raise invalid("message must be valid JSON, nested at most "
                      f"{MAX_JSON_DEPTH} levels") from None
    depth, values = json_shape(message)
    if depth > MAX_JSON_DEPTH or values > MAX_JSON_VALUES:
        del message  # freed here (a worker thread's), not where the error is caught
    if depth > MAX_JSON_DEPTH:
        raise invalid(f"message nests deeper than {MAX_JSON_DEPTH} levels")
    if values > MAX_JSON_VALUES:
        raise too_many_values()
    if not isinstance(message, dict):
        raise invalid("message must be a JSON object")
    return message


@dataclass(frozen=True)
class ToolOutput:
    """A ``function_call_output`` item: a tool call's result (both dialects' shape)."""

    call_id: str
    output: str


def parse_tool_output(item: Any) -> ToolOutput:
    """``conversation.item.create.item`` of type ``function_call_output``."""
    if not isinstance(item, dict) or item.get("type") != "function_call_output":
        raise invalid("conversation.item.create supports only items of type function_call_output")
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise invalid("function_call_output.call_id must be a non-empty string")
    if not isinstance(output, str):
        raise invalid("function_call_output.output must be a string")
    return ToolOutput(call_id, output)


def decode_base64(text: Any, what: str) -> bytes:
    """Base64 ``text`` (``ValueError`` naming ``what``, e.g. ``"base64 PCM16"``)."""
    if not isinstance(text, str):
        raise ValueError(f"audio must be {what} text")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"audio must be valid {what}") from None


def pcm16_samples(data: bytes, what: str) -> np.ndarray:
    """Little-endian PCM16 mono -> float32 in [-1, 1) (``ValueError`` for an odd length)."""
    if len(data) % 2:
        raise ValueError(f"{what} audio must contain an even number of bytes")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / PCM16_FULL_SCALE


def pcm16_bytes(samples: np.ndarray) -> bytes:
    """Float samples -> little-endian PCM16 (``round(clip(x) * 32767)``)."""
    return to_pcm16(samples, PCM16_OUTPUT_SCALE).tobytes()


# --- server events -----------------------------------------------------------


def dumps(payload: dict[str, Any]) -> str:
    """A server event as sent: stamped with a new ``event_id``, compact JSON."""
    return json.dumps({"event_id": new_id("event"), **payload}, ensure_ascii=False,
                      separators=(",", ":"))


def bounded(message: str) -> str:
    """``message`` cut to :data:`MAX_ERROR_CHARS` (it may quote client input)."""
    return cut(message, MAX_ERROR_CHARS)
