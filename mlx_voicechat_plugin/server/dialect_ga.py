"""The OpenAI Realtime GA dialect on the wire: client events in, the session object, errors.

Served at ``/openai/v1/realtime`` (the mlx-vlm dialect stays at
``/v1/realtime``), so a GA client's ``base_url`` is ``http://HOST:PORT/openai/v1``.
Client events are parsed into :class:`ClientEvent` (``kind`` and the fields
the connection needs); ``session.update`` merges into a :class:`GAConfig`, as
GA clients send partial updates (LiveKit sends its tools in one of their own).
Unknown session keys are ignored, known ones are checked and named in the
error. The runtime events' translation into responses is
:mod:`.dialect_ga_responses`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from ..runtime.quoting import brief
from . import protocol
from .audio_formats import AudioFormat, FormatError, parse_format
from .protocol import ErrorCode, ProtocolError

REALTIME_PATH = "/openai/v1/realtime"
DEFAULT_SILENCE_MS = 800  # the user's turn ends after this long without transcript tokens
DEFAULT_TURN_DETECTION: dict[str, Any] = {
    "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 0,
    "silence_duration_ms": DEFAULT_SILENCE_MS, "create_response": True,
    "interrupt_response": False,
}
# A response runs at most this long on the timeline (``session.max_response_seconds``):
# from the request that opened it (commit with turn detection off, response.create)
# or from the model's first word; the server runs silence meanwhile if the client
# sends no audio (like offline ``extra_decoding_seconds``).
DEFAULT_MAX_RESPONSE_SECONDS = 15.0
MAX_RESPONSE_SECONDS = 600.0
TOOL_CHOICES = ("auto", "none")
MODALITIES = (["audio"], ["text"])


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(protocol.ID_HEX_CHARS // 2)}"


@dataclass(frozen=True)
class GAConfig:
    """What a GA session has been told; what the engine needs is :meth:`engine_options`."""

    instructions: str | None = None
    tools: list[Any] = field(default_factory=list)
    tool_choice: str = "auto"
    output_modalities: tuple[str, ...] = ("audio",)
    input_format: AudioFormat = AudioFormat()
    output_format: AudioFormat = AudioFormat()
    turn_detection: dict[str, Any] | None = field(
        default_factory=lambda: dict(DEFAULT_TURN_DETECTION))
    transcription: dict[str, Any] | None = None
    voice: str = "default"
    speed: float = 1.0
    seed: int = 0  # extension, as in the mlx-vlm dialect
    max_streaming_seconds: float | None = None  # extension, as in the mlx-vlm dialect
    max_response_seconds: float = DEFAULT_MAX_RESPONSE_SECONDS  # extension, see above

    def engine_options(self) -> tuple[Any, ...]:
        """The part only a new engine session can change (prefilled prompt, tools, seed)."""
        tools = None if not self.tools or self.tool_choice == "none" else self.tools
        return (self.instructions or None, json.dumps(tools, sort_keys=True), self.seed,
                self.max_streaming_seconds)

    def engine_tools(self) -> list[Any] | None:
        return None if not self.tools or self.tool_choice == "none" else list(self.tools)

    @property
    def silence_ms(self) -> int:
        value = (self.turn_detection or {}).get("silence_duration_ms")
        return value if isinstance(value, int) and value > 0 else DEFAULT_SILENCE_MS


def _failed(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.SESSION_INITIALIZATION_FAILED, message)


def merge_session(config: GAConfig, payload: Any) -> GAConfig:
    """``session.update.session`` applied to ``config``; a bad field fails the whole update."""
    if not isinstance(payload, dict):
        raise _failed("session must be an object")
    kind = payload.get("type", "realtime")
    if kind != "realtime":
        raise _failed(f"session.type must be 'realtime', got {brief(kind)}")
    changes: dict[str, Any] = {}
    if "instructions" in payload:
        text = payload["instructions"]
        if text is not None and not isinstance(text, str):
            raise _failed("session.instructions must be a string")
        changes["instructions"] = text
    if "tools" in payload:
        tools = payload["tools"]
        if tools is not None and not isinstance(tools, list):
            raise _failed("session.tools must be a list of function tools")
        changes["tools"] = list(tools or [])
    if payload.get("tool_choice") is not None:
        choice = payload["tool_choice"]
        if choice not in TOOL_CHOICES:
            raise _failed(f"session.tool_choice must be one of {', '.join(TOOL_CHOICES)} (the "
                          f"model decides when it calls a tool), got {brief(choice)}")
        changes["tool_choice"] = choice
    if "output_modalities" in payload:
        modalities = payload["output_modalities"]
        if modalities not in MODALITIES:
            raise _failed("session.output_modalities must be ['audio'] or ['text'], "
                          f"got {brief(modalities)}")
        changes["output_modalities"] = tuple(modalities)
    changes.update(_audio_changes(payload.get("audio")))
    extras = protocol.parse_session({key: payload[key] for key in
                                     ("seed", "max_streaming_seconds") if key in payload})
    if "seed" in payload:
        changes["seed"] = extras.seed
    if "max_streaming_seconds" in payload:
        changes["max_streaming_seconds"] = extras.max_streaming_seconds
    if payload.get("max_response_seconds") is not None:
        changes["max_response_seconds"] = _response_seconds(payload["max_response_seconds"])
    return replace(config, **changes)


def _response_seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value <= MAX_RESPONSE_SECONDS:
        raise _failed(f"session.max_response_seconds must be within (0, "
                      f"{MAX_RESPONSE_SECONDS:g}] s, got {brief(value)}")
    return float(value)


def _audio_changes(audio: Any) -> dict[str, Any]:
    if audio is None:
        return {}
    if not isinstance(audio, dict):
        raise _failed("session.audio must be an object")
    changes: dict[str, Any] = {}
    for side in ("input", "output"):
        part = audio.get(side)
        if part is None:
            continue
        if not isinstance(part, dict):
            raise _failed(f"session.audio.{side} must be an object")
        if part.get("format") is not None:
            try:
                changes[f"{side}_format"] = parse_format(part["format"],
                                                         f"session.audio.{side}.format")
            except FormatError as exc:
                raise _failed(str(exc)) from None
    source = audio.get("input") or {}
    if "turn_detection" in source:
        detection = source["turn_detection"]
        if detection is not None and not isinstance(detection, dict):
            raise _failed("session.audio.input.turn_detection must be an object or null")
        changes["turn_detection"] = None if detection is None else \
            {**DEFAULT_TURN_DETECTION, **detection}
    if "transcription" in source:
        changes["transcription"] = source["transcription"]
    sink = audio.get("output") or {}
    if isinstance(sink.get("voice"), str):
        changes["voice"] = sink["voice"]
    if isinstance(sink.get("speed"), (int, float)) and not isinstance(sink.get("speed"), bool):
        changes["speed"] = float(sink["speed"])
    return changes


def session_object(session_id: str, model_id: str, config: GAConfig) -> dict[str, Any]:
    """The GA ``realtime.session`` object of ``session.created`` / ``session.updated``."""
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model_id,
        "output_modalities": list(config.output_modalities),
        "instructions": config.instructions or "",
        "tools": list(config.tools),
        "tool_choice": config.tool_choice,
        "max_output_tokens": "inf",
        "tracing": None,
        "prompt": None,
        "expires_at": 0,
        "include": None,
        "audio": {
            "input": {"format": config.input_format.describe(),
                      "transcription": config.transcription, "noise_reduction": None,
                      "turn_detection": config.turn_detection},
            "output": {"format": config.output_format.describe(), "voice": config.voice,
                       "speed": config.speed},
        },
    }


def session_event(kind: str, session_id: str, model_id: str, config: GAConfig) -> dict[str, Any]:
    return {"type": kind, "session": session_object(session_id, model_id, config)}


ERROR_TYPES = {ErrorCode.SERVER_BUSY: "server_error", ErrorCode.INFERENCE_ERROR: "server_error"}


def error_event(code: str, message: str, event_id: str | None = None,
                param: str | None = None) -> dict[str, Any]:
    """A GA ``error``: ``type`` (``invalid_request_error`` / ``server_error``), ``code``,
    ``message``, ``param`` and the ``event_id`` of the client event it answers."""
    return {"type": "error", "error": {
        "type": ERROR_TYPES.get(code, "invalid_request_error"), "code": code,
        "message": protocol.bounded(message), "param": param, "event_id": event_id}}


# --- client events --------------------------------------------------------

CLIENT_EVENTS = (
    "session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
    "input_audio_buffer.clear", "conversation.item.create", "conversation.item.truncate",
    "conversation.item.delete", "response.create", "response.cancel",
)


@dataclass(frozen=True)
class ClientEvent:
    kind: str
    message: dict[str, Any]
    event_id: str | None = None


def parse_client_event(text: str) -> ClientEvent:
    """One text frame -> a GA client event (``invalid_request`` when malformed or unknown)."""
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "message must be valid JSON, nested at "
                            f"most {protocol.MAX_JSON_DEPTH} levels") from None
    if protocol.json_depth(message) > protocol.MAX_JSON_DEPTH:
        raise ProtocolError(ErrorCode.INVALID_REQUEST,
                            f"message nests deeper than {protocol.MAX_JSON_DEPTH} levels")
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "message must be a JSON object")
    event_id = message.get("event_id") if isinstance(message.get("event_id"), str) else None
    kind = message.get("type")
    if kind not in CLIENT_EVENTS:
        error = ProtocolError(ErrorCode.INVALID_REQUEST, f"unsupported event type {brief(kind)}")
        error.event_id = event_id  # the error event names the event it answers
        raise error
    return ClientEvent(kind, message, event_id)
