"""Wire format of the realtime protocol: client messages in, server events out.

Client messages are JSON objects with a ``type``; each is parsed into a small
dataclass or rejected with a :class:`ProtocolError` carrying the error code the
client sees. Server events are dicts stamped with an ``event_id``.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from ..runtime.audio import to_pcm16
from ..runtime.quoting import brief
from ..runtime.options import check_positive_seconds
from ..runtime.rng import check_seed
from ..runtime.events import (
    AssistantTextDelta,
    Audio,
    Cancelled,
    Done,
    Event,
    FunctionDelta,
    ToolCall,
    ToolCallInvalid,
    ToolResultInjected,
    ToolsWarning,
    UserTranscriptDelta,
)
from ..runtime.transcribe import TranscriptDone

INPUT_SAMPLE_RATE = 16_000
PCM16_FULL_SCALE = 32768.0  # input decode: int16 / 32768
PCM16_OUTPUT_SCALE = 32767.0  # output encode: round(clip(x) * 32767)
ID_HEX_CHARS = 16


class ErrorCode:
    INVALID_REQUEST = "invalid_request"
    SERVER_BUSY = "server_busy"
    SESSION_INITIALIZATION_FAILED = "session_initialization_failed"
    INFERENCE_ERROR = "inference_error"
    TOOLS_NOT_SET = "tools_not_set"
    TOOL_CALL_INVALID = "tool_call_invalid"


class CloseCode:
    NORMAL = 1000
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    TRY_AGAIN_LATER = 1013


class ProtocolError(Exception):
    """A client mistake, answered with an ``error`` event of ``code``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def new_event_id() -> str:
    return "event_" + secrets.token_hex(ID_HEX_CHARS // 2)


def new_session_id() -> str:
    return "sess_" + secrets.token_hex(ID_HEX_CHARS // 2)


# --- client messages ----------------------------------------------------


@dataclass(frozen=True)
class SessionUpdate:
    system_prompt: str | None = None
    seed: int = 0
    max_streaming_seconds: float | None = None
    model: Any = None  # accepted and ignored: the server serves one checkpoint
    tools: list[Any] | None = None  # validated by the runtime when the session opens
    output_modalities: tuple[str, ...] = ("text", "audio")

    @property
    def text_only(self) -> bool:
        """``output_modalities: ["text"]``: only the user transcript (perception + RNNT)."""
        return self.output_modalities == ("text",)


@dataclass(frozen=True)
class AudioAppend:
    audio: Any  # base64 text, decoded by :func:`decode_pcm16`
    sample_rate: Any = INPUT_SAMPLE_RATE


@dataclass(frozen=True)
class Commit:
    pad_partial: bool = True


@dataclass(frozen=True)
class Cancel:
    pass


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class ToolOutput:
    """``conversation.item.create`` with a ``function_call_output`` item."""

    call_id: str
    output: str


ClientMessage = Union[SessionUpdate, AudioAppend, Commit, Cancel, Ping, ToolOutput]


def _invalid(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_REQUEST, message)


def _init_failed(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.SESSION_INITIALIZATION_FAILED, message)


def parse_session(payload: Any) -> SessionUpdate:
    """Validate ``session.update.session``; bad fields are ``session_initialization_failed``."""
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise _init_failed("session must be an object")
    prompt = payload.get("system_prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise _init_failed("session.system_prompt must be a string")
    seed = payload.get("seed", 0)
    if seed is None:
        seed = 0
    try:
        check_seed(seed, "session.seed")
    except ValueError as exc:
        raise _init_failed(str(exc)) from None
    limit = payload.get("max_streaming_seconds")
    if limit is not None:
        try:
            limit = check_positive_seconds(limit, "session.max_streaming_seconds")
        except ValueError as exc:
            raise _init_failed(str(exc)) from None
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _init_failed("session.tools must be a list of tool definitions")
    modalities = parse_modalities(payload.get("output_modalities"))
    if modalities == ("text",) and tools is not None:
        raise _init_failed("session.tools needs the full session; a text-only session "
                           "(output_modalities ['text']) only transcribes")
    return SessionUpdate(prompt, seed, limit, payload.get("model"), tools, modalities)


MODALITIES = ("text", "audio")


def parse_modalities(value: Any) -> tuple[str, ...]:
    """``session.output_modalities``: ``["text"]`` (transcript only) or with ``"audio"``."""
    if value is None:
        return MODALITIES
    if not isinstance(value, list) or not value or len(value) > len(MODALITIES) \
            or any(m not in MODALITIES for m in value) or len(set(value)) != len(value):
        raise _init_failed("session.output_modalities must be ['text'] or ['text', 'audio'], "
                           f"got {brief(value)}")
    if value == ["audio"]:
        raise _init_failed("session.output_modalities ['audio'] is not supported: the "
                           "assistant's text comes with its audio; use ['text', 'audio']")
    return tuple(m for m in MODALITIES if m in value)


def parse_item(item: Any) -> ToolOutput:
    """``conversation.item.create.item``: only ``function_call_output`` is supported."""
    if not isinstance(item, dict) or item.get("type") != "function_call_output":
        raise _invalid("conversation.item.create supports only items of type function_call_output")
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise _invalid("function_call_output.call_id must be a non-empty string")
    if not isinstance(output, str):
        raise _invalid("function_call_output.output must be a string")
    return ToolOutput(call_id, output)


MAX_JSON_DEPTH = 32  # nesting of objects and arrays a client message may have
MAX_ERROR_CHARS = 240  # an error message (client values inside it included) is cut to this


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item \
            if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_message(text: str) -> ClientMessage:
    """One text frame -> a client message (``invalid_request`` when malformed)."""
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):  # the decoder recurses once per nesting level
        raise _invalid("message must be valid JSON, nested at most "
                       f"{MAX_JSON_DEPTH} levels") from None
    if json_depth(message) > MAX_JSON_DEPTH:
        raise _invalid(f"message nests deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(message, dict):
        raise _invalid("message must be a JSON object")
    kind = message.get("type")
    if kind == "session.update":
        return parse_session(message.get("session"))
    if kind == "input_audio_buffer.append":
        return AudioAppend(message.get("audio"), message.get("sample_rate", INPUT_SAMPLE_RATE))
    if kind == "input_audio_buffer.commit":
        pad = message.get("pad_partial", True)
        if not isinstance(pad, bool):
            raise _invalid("pad_partial must be a boolean")
        return Commit(pad)
    if kind in ("session.cancel", "response.cancel"):
        return Cancel()
    if kind == "session.ping":
        return Ping()
    if kind == "conversation.item.create":
        return parse_item(message.get("item"))
    raise _invalid(f"unsupported event type {brief(kind)}")


def decode_pcm16(audio: Any) -> np.ndarray:
    """Base64 little-endian PCM16 mono -> float32 in [-1, 1) (``inference_error`` if bad)."""
    if not isinstance(audio, str):
        raise ProtocolError(ErrorCode.INFERENCE_ERROR, "audio must be base64 PCM16 text")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(ErrorCode.INFERENCE_ERROR, "audio must be valid base64 PCM16") from None
    if len(raw) % 2:
        raise ProtocolError(ErrorCode.INFERENCE_ERROR,
                            "PCM16 audio must contain an even number of bytes")
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / PCM16_FULL_SCALE


def check_sample_rate(rate: Any, expected: int = INPUT_SAMPLE_RATE) -> int:
    if isinstance(rate, bool) or not isinstance(rate, int):
        raise ProtocolError(ErrorCode.INFERENCE_ERROR,
                            f"sample_rate must be an integer, got {brief(rate)}")
    if rate != expected:
        raise ProtocolError(ErrorCode.INFERENCE_ERROR,
                            f"sample_rate must be {expected} Hz, got {rate}")
    return rate


# --- server events ------------------------------------------------------


def stamp(payload: dict[str, Any]) -> dict[str, Any]:
    return {"event_id": new_event_id(), **payload}


def dumps(payload: dict[str, Any]) -> str:
    return json.dumps(stamp(payload), ensure_ascii=False, separators=(",", ":"))


def bounded(message: str) -> str:
    """``message`` cut to :data:`MAX_ERROR_CHARS` (it may quote client input)."""
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


def error_event(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"code": code, "message": bounded(message)}}


def audio_format(sample_rate: int) -> dict[str, Any]:
    return {"type": "pcm16", "sample_rate": sample_rate, "channels": 1}


def session_created(session_id: str, input_rate: int, output_rate: int) -> dict[str, Any]:
    return {
        "type": "session.created",
        "session": {
            "id": session_id,
            "state": "configuring",
            "input_audio_format": audio_format(input_rate),
            "output_audio_format": audio_format(output_rate),
        },
    }


def session_updated(session_id: str, model: str, details: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "session.updated",
        "session": {
            "id": session_id,
            "state": "ready",
            "model": model,
            "frame_samples": details["frame_samples"],
            "max_streaming_seconds": details["max_streaming_seconds"],
            "input_audio_format": audio_format(details["input_sample_rate"]),
            "output_audio_format": audio_format(details["output_sample_rate"]),
            **({"output_modalities": ["text"]} if details.get("text_only") else {}),
        },
    }


def encode_pcm16(samples: np.ndarray) -> str:
    return base64.b64encode(to_pcm16(samples, PCM16_OUTPUT_SCALE).tobytes()).decode("ascii")


def model_event(event: Event) -> dict[str, Any]:
    """A runtime event as its server event.

    For the kinds the reference serializer has (``mlx_vlm/server/realtime.py``,
    ``_serialize_model_event``) the type names, field names and JSON types are
    the reference's: text and function deltas carry ``delta``/``text``, the
    user transcript ``delta``/``transcript``, audio its PCM16 in ``delta`` with
    ``audio_codes``. ``conformance.wire`` diffs them field for field.
    """
    index = {"frame_index": int(event.frame_index)}
    if isinstance(event, AssistantTextDelta):
        return {"type": "response.text.delta", "delta": event.delta, "text": event.text,
                "token_id": int(event.token_id), **index}
    if isinstance(event, FunctionDelta):
        return {"type": "response.function.delta", "delta": event.delta, "text": event.text,
                "token_id": int(event.token_id), **index}
    if isinstance(event, UserTranscriptDelta):
        return {"type": "conversation.item.input_audio_transcription.delta",
                "delta": event.delta, "transcript": event.text, **index}
    if isinstance(event, TranscriptDone):
        return {"type": "conversation.item.input_audio_transcription.completed",
                "transcript": event.text, **index}
    if isinstance(event, Audio):
        return {"type": "response.audio.delta", "delta": encode_pcm16(event.samples),
                "format": "pcm16", "sample_rate": int(event.sample_rate), "channels": 1,
                "audio_codes": np.asarray(event.audio_codes).astype(int).tolist(), **index}
    if isinstance(event, Done):
        return {"type": "response.done", **index}
    if isinstance(event, Cancelled):
        return {"type": "response.cancelled", **index}
    if isinstance(event, ToolCall):
        return {"type": "response.function_call_arguments.done", "call_id": event.call_id,
                "name": event.name, "arguments": event.arguments, **index}
    if isinstance(event, ToolCallInvalid):
        payload = error_event(ErrorCode.TOOL_CALL_INVALID, event.message)
        payload["error"].update(reason=event.reason, raw=event.raw, **index)
        return payload
    if isinstance(event, ToolResultInjected):
        return {"type": "conversation.item.function_call_output.injected",
                "call_id": event.call_id, "first_frame_index": int(event.first_frame),
                "num_tokens": int(event.num_tokens), **index}
    if isinstance(event, ToolsWarning):
        return {"type": "session.warning", "message": event.message, **index}
    raise TypeError(f"unsupported event {type(event).__name__}")
