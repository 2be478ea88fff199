"""The OpenAI Realtime GA session on the wire: what ``session.update`` says, the session object.

GA clients send partial updates (LiveKit sends its tools in one of their
own), so each ``session.update`` merges into a :class:`GAConfig`. Unknown
session keys are ignored, known ones are checked and named in the error;
the fields the runtime's options hold (``instructions``, ``seed``,
``max_streaming_seconds``, ``context_seconds``) are checked once, when the dialect builds the
session's options from the config (:mod:`.ga`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ....quoting import brief
from ...wire import ErrorCode, bounded, init_failed
from .audio import AudioFormat, FormatError, parse_format

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
# turn_detection as GA types it (the session object echoes what the client sent).
VAD_TYPES = ("server_vad", "semantic_vad")
VAD_MS = ("prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms")
VAD_FLAGS = ("create_response", "interrupt_response")
EAGERNESS = ("low", "medium", "high", "auto")
MODALITIES = (["audio"], ["text"])


@dataclass(frozen=True)
class GAConfig:
    """What a GA session has been told (the runtime's fields as the client sent them)."""

    instructions: Any = None
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
    seed: Any = 0  # extension, as in the mlx-vlm dialect
    max_streaming_seconds: Any = None  # extension, as in the mlx-vlm dialect
    context_seconds: Any = None  # extension: the bounded context (None: the server's)
    max_response_seconds: float = DEFAULT_MAX_RESPONSE_SECONDS  # extension, see above

    @property
    def system_prompt(self) -> Any:
        """The prompt the session is prefilled with (empty instructions: none)."""
        return None if self.instructions == "" else self.instructions

    def engine_tools(self) -> list[Any] | None:
        """The function tools (``mcp`` tools are the server's to connect: ga/mcp_tools.py)."""
        tools = [t for t in self.tools if not is_mcp(t)]
        return None if not tools or self.tool_choice == "none" else tools

    @property
    def silence_ms(self) -> int:
        value = (self.turn_detection or {}).get("silence_duration_ms")
        return value if isinstance(value, int) and value > 0 else DEFAULT_SILENCE_MS


def is_mcp(tool: Any) -> bool:
    """Whether a session tool is OpenAI's ``{"type": "mcp"}`` (an MCP server by URL)."""
    return isinstance(tool, dict) and tool.get("type") == "mcp"


def echoed_tool(tool: Any) -> Any:
    """A tool as ``session.updated`` echoes it: an ``mcp`` tool without its secrets."""
    if not is_mcp(tool):
        return tool
    return {k: v for k, v in tool.items() if k not in ("headers", "authorization")}


def merge_session(config: GAConfig, payload: Any) -> GAConfig:
    """``session.update.session`` applied to ``config``; a bad field fails the whole update."""
    if not isinstance(payload, dict):
        raise init_failed("session must be an object")
    kind = payload.get("type", "realtime")
    if kind != "realtime":
        raise init_failed(f"session.type must be 'realtime', got {brief(kind)}")
    changes: dict[str, Any] = {}
    if "instructions" in payload:
        changes["instructions"] = payload["instructions"]
    if "tools" in payload:
        tools = payload["tools"]
        if tools is not None and not isinstance(tools, list):
            raise init_failed("session.tools must be a list of function tools")
        changes["tools"] = list(tools or [])
    if payload.get("tool_choice") is not None:
        choice = payload["tool_choice"]
        if choice not in TOOL_CHOICES:
            raise init_failed(f"session.tool_choice must be one of {', '.join(TOOL_CHOICES)} "
                              f"(the model decides when it calls a tool), got {brief(choice)}")
        changes["tool_choice"] = choice
    if "output_modalities" in payload:
        modalities = payload["output_modalities"]
        if modalities not in MODALITIES:
            raise init_failed("session.output_modalities must be ['audio'] or ['text'], "
                              f"got {brief(modalities)}")
        changes["output_modalities"] = tuple(modalities)
    changes.update(_audio_changes(payload.get("audio")))
    if "seed" in payload:
        changes["seed"] = 0 if payload["seed"] is None else payload["seed"]
    if "max_streaming_seconds" in payload:
        changes["max_streaming_seconds"] = payload["max_streaming_seconds"]
    if "context_seconds" in payload:
        changes["context_seconds"] = payload["context_seconds"]
    if payload.get("max_response_seconds") is not None:
        changes["max_response_seconds"] = _response_seconds(payload["max_response_seconds"])
    return replace(config, **changes)


def _response_seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value <= MAX_RESPONSE_SECONDS:
        raise init_failed(f"session.max_response_seconds must be within (0, "
                          f"{MAX_RESPONSE_SECONDS:g}] s, got {brief(value)}")
    return float(value)


def _audio_changes(audio: Any) -> dict[str, Any]:
    if audio is None:
        return {}
    if not isinstance(audio, dict):
        raise init_failed("session.audio must be an object")
    changes: dict[str, Any] = {}
    for side in ("input", "output"):
        part = audio.get(side)
        if part is None:
            continue
        if not isinstance(part, dict):
            raise init_failed(f"session.audio.{side} must be an object")
        if part.get("format") is not None:
            try:
                changes[f"{side}_format"] = parse_format(part["format"],
                                                         f"session.audio.{side}.format")
            except FormatError as exc:
                raise init_failed(str(exc)) from None
    source = audio.get("input") or {}
    if "turn_detection" in source:
        changes["turn_detection"] = _turn_detection(source["turn_detection"])
    if "transcription" in source:
        if source["transcription"] is not None and not isinstance(source["transcription"], dict):
            raise init_failed("session.audio.input.transcription must be an object or null")
        changes["transcription"] = source["transcription"]
    sink = audio.get("output") or {}
    if isinstance(sink.get("voice"), str):
        changes["voice"] = sink["voice"]
    if isinstance(sink.get("speed"), (int, float)) and not isinstance(sink.get("speed"), bool):
        changes["speed"] = float(sink["speed"])
    return changes


def _turn_detection(detection: Any) -> dict[str, Any] | None:
    """``turn_detection`` over the defaults, its fields checked as GA types them (the
    session object echoes it)."""
    where = "session.audio.input.turn_detection"
    if detection is None:
        return None
    if not isinstance(detection, dict):
        raise init_failed(f"{where} must be an object or null")
    merged = {**DEFAULT_TURN_DETECTION, **detection}
    if merged["type"] not in VAD_TYPES:
        raise init_failed(f"{where}.type must be one of {', '.join(VAD_TYPES)}, "
                          f"got {brief(merged['type'])}")
    for key in VAD_MS:
        value = merged.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise init_failed(f"{where}.{key} must be a non-negative integer (ms), "
                              f"got {brief(value)}")
    for key in VAD_FLAGS:
        if not isinstance(merged.get(key), bool):
            raise init_failed(f"{where}.{key} must be true or false, got {brief(merged.get(key))}")
    threshold = merged.get("threshold")
    if threshold is not None and (isinstance(threshold, bool)
                                  or not isinstance(threshold, (int, float))):
        raise init_failed(f"{where}.threshold must be a number, got {brief(threshold)}")
    if merged.get("eagerness", "auto") not in EAGERNESS:
        raise init_failed(f"{where}.eagerness must be one of {', '.join(EAGERNESS)}, "
                          f"got {brief(merged['eagerness'])}")
    return merged


def session_object(session_id: str, model_id: str, config: GAConfig) -> dict[str, Any]:
    """The GA ``realtime.session`` object of ``session.created`` / ``session.updated``."""
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model_id,
        "output_modalities": list(config.output_modalities),
        "instructions": config.instructions or "",
        "tools": [echoed_tool(t) for t in config.tools],
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
        "message": bounded(message), "param": param, "event_id": event_id}}
