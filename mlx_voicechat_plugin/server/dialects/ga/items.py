"""The GA wire shapes of a response and of conversation items.

Pure builders: each takes what the event says and returns its JSON object.
When to send which is :mod:`.responses`' business (the response lifecycle);
the session object is built in :mod:`.config`.
"""

from __future__ import annotations

from typing import Any

from ...wire import new_id
from .config import GAConfig

# Response status -> its ``status_details`` (``failed`` carries the error message).
_DETAILS = {
    "cancelled": {"type": "cancelled", "reason": "client_cancelled"},
    # max_response_seconds of timeline passed: GA's nearest reason.
    "incomplete": {"type": "incomplete", "reason": "max_output_tokens"},
}


def usage(heard_frames: int, text_tokens: int, audio_frames: int) -> dict[str, Any]:
    """A response's ``usage``: frames heard in, text tokens and audio frames out."""
    spoken = text_tokens + audio_frames
    return {
        "total_tokens": heard_frames + spoken, "input_tokens": heard_frames,
        "output_tokens": spoken,
        "input_token_details": {"text_tokens": 0, "audio_tokens": heard_frames,
                                "cached_tokens": 0},
        "output_token_details": {"text_tokens": text_tokens, "audio_tokens": audio_frames},
    }


def response_object(response_id: str, config: GAConfig, output: list[dict[str, Any]],
                    metadata: Any, status: str = "in_progress",
                    usage: dict[str, Any] | None = None,
                    failure: str | None = None) -> dict[str, Any]:
    """A ``realtime.response``: ``status`` is in_progress, completed, incomplete,
    cancelled or failed (with ``failure``, the error message)."""
    details = dict(_DETAILS[status]) if status in _DETAILS else None
    if status == "failed":
        details = {"type": "failed", "error": {
            "type": "server_error", "code": "inference_error", "message": failure}}
    return {
        "id": response_id, "object": "realtime.response", "status": status,
        "status_details": details, "output": list(output),
        "conversation_id": None, "output_modalities": list(config.output_modalities),
        "max_output_tokens": "inf",
        "audio": {"output": {"format": config.output_format.describe(),
                             "voice": config.voice}},
        "usage": usage, "metadata": metadata,
    }


def assistant_message(item_id: str, status: str = "in_progress",
                      content: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": status,
            "role": "assistant", "content": content or []}


def content_part(audio_out: bool, text: str) -> dict[str, Any]:
    """The ``part`` of ``response.content_part.added`` / ``done``."""
    return {"type": "audio", "transcript": text} if audio_out else {"type": "text", "text": text}


def message_content(audio_out: bool, text: str) -> dict[str, Any]:
    """A finished assistant message's content entry."""
    return {"type": "output_audio", "transcript": text} if audio_out \
        else {"type": "output_text", "text": text}


def function_call(item_id: str, call_id: str, name: str, arguments: str = "",
                  status: str = "in_progress") -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "function_call",
            "status": status, "call_id": call_id, "name": name, "arguments": arguments}


def user_message(item_id: str, transcript: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message",
            "status": "completed", "role": "user",
            "content": [{"type": "input_audio", "transcript": transcript}]}


def tool_output_item(item: dict[str, Any]) -> dict[str, Any]:
    """A client's ``function_call_output`` item as the server echoes it (id given or new)."""
    return {"id": item.get("id") if isinstance(item.get("id"), str) else new_id("item"),
            "object": "realtime.item", "type": "function_call_output", "status": "completed",
            "call_id": item["call_id"], "output": item["output"]}
