"""The NVIDIA VoiceChat dialect's client messages and session configuration, parsed.

As NeMo-Speech.cpp's ``docs/api.md`` ("VoiceChat WebSocket /v1/realtime")
and its reference client have them: ``session.update`` with
``audio.input.format`` (``"pcm16"``, 24 kHz, or ``{"type": "audio/pcm",
"rate": R}`` with R in 16-48 kHz), ``audio.output.format`` (PCM16 at 24 kHz
only), ``instructions`` (at most 32,000 characters) and ``tools`` (an array
or a JSON string of one; flat or ``{"function": {...}}``, with
``ack_messages``: the runtime's tool parser takes both shapes);
``input_audio_buffer.append`` (base64 PCM16) or a binary frame (raw PCM16);
``conversation.item.create`` with a ``function_call_output``;
``session.close``. A malformed message is an ``invalid_event``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Union

from ....quoting import brief
from ...wire import ProtocolError, ToolOutput, invalid, load_object, parse_tool_output

INSTRUCTIONS_TOO_LONG = "instructions_too_long"
MAX_INSTRUCTIONS_CHARS = 32_000
DEFAULT_RATE = 24_000
MIN_RATE, MAX_RATE = 16_000, 48_000
PCM_TYPES = ("audio/pcm", "pcm16")


@dataclass(frozen=True)
class Config:
    """The session's effective configuration (``session.updated`` reports it)."""

    input_rate: int = DEFAULT_RATE
    instructions: str | None = None
    tools: list[Any] = field(default_factory=list)

    def describe(self, session_id: str, model: str) -> dict[str, Any]:
        fmt = {"type": "audio/pcm", "rate": self.input_rate}
        return {"id": session_id, "object": "realtime.session", "model": model,
                "audio": {"input": {"format": fmt},
                          "output": {"format": {"type": "audio/pcm", "rate": DEFAULT_RATE}}},
                "instructions": self.instructions or "", "tools": list(self.tools)}


@dataclass(frozen=True)
class Update:
    session: dict[str, Any]


@dataclass(frozen=True)
class Append:
    audio: Any  # base64 text (an append event) or bytes (a binary frame)


@dataclass(frozen=True)
class Close:
    pass


ClientMessage = Union[Update, Append, Close, ToolOutput]


def parse_message(message: str | bytes) -> ClientMessage:
    """One client frame; a binary frame is audio."""
    if isinstance(message, bytes):
        return Append(message)
    event = load_object(message)
    kind = event.get("type")
    if kind == "session.update":
        session = event.get("session", {})
        if not isinstance(session, dict):
            raise invalid("session must be an object")
        return Update(session)
    if kind == "input_audio_buffer.append":
        return Append(event.get("audio"))
    if kind == "session.close":
        return Close()
    if kind == "conversation.item.create":
        return parse_tool_output(event.get("item"))
    raise invalid(f"unsupported event type {brief(kind)}")


def input_rate(value: Any) -> int:
    """``audio.input.format``: ``"pcm16"`` (24 kHz) or ``{"type": "audio/pcm", "rate": R}``."""
    if value in PCM_TYPES:
        return DEFAULT_RATE
    if not isinstance(value, dict) or value.get("type") not in PCM_TYPES:
        raise invalid("session.audio.input.format must be \"pcm16\" or "
                      f"{{\"type\": \"audio/pcm\", \"rate\": R}}, got {brief(value)}")
    rate = value.get("rate", DEFAULT_RATE)
    if isinstance(rate, bool) or not isinstance(rate, int) or not MIN_RATE <= rate <= MAX_RATE:
        raise invalid(f"session.audio.input.format.rate must be an integer from {MIN_RATE} "
                      f"to {MAX_RATE} Hz, got {brief(rate)}")
    return rate


def check_output(value: Any) -> None:
    """``audio.output.format``: PCM16 at 24 kHz only."""
    if value in PCM_TYPES:
        return
    if isinstance(value, dict) and value.get("type") in PCM_TYPES \
            and value.get("rate", DEFAULT_RATE) == DEFAULT_RATE:
        return
    raise invalid(f"session.audio.output.format must select PCM16 at {DEFAULT_RATE} Hz, "
                  f"got {brief(value)}")


def parse_tools(value: Any) -> list[Any]:
    """``tools``: an array, or a JSON string of one (``null``: none)."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise invalid("session.tools must be a JSON array of tools") from None
    if not isinstance(value, list):
        raise invalid("session.tools must be an array of tools")
    return value


def updated(config: Config, session: dict[str, Any]) -> Config:
    """``config`` with a ``session.update``'s fields (absent ones unchanged)."""
    changes: dict[str, Any] = {}
    audio = session.get("audio")
    if audio is not None:
        if not isinstance(audio, dict):
            raise invalid("session.audio must be an object")
        inp, out = audio.get("input") or {}, audio.get("output") or {}
        if not isinstance(inp, dict) or not isinstance(out, dict):
            raise invalid("session.audio.input and .output must be objects")
        if inp.get("format") is not None:
            changes["input_rate"] = input_rate(inp["format"])
        if out.get("format") is not None:
            check_output(out["format"])
    if "instructions" in session:
        text = session["instructions"]
        if text is not None and not isinstance(text, str):
            raise invalid("session.instructions must be a string")
        if text is not None and len(text) > MAX_INSTRUCTIONS_CHARS:
            raise ProtocolError(INSTRUCTIONS_TOO_LONG,
                                f"instructions have {len(text)} characters; at most "
                                f"{MAX_INSTRUCTIONS_CHARS} are allowed")
        changes["instructions"] = text or None
    if "tools" in session:
        changes["tools"] = parse_tools(session["tools"])
    return replace(config, **changes)
