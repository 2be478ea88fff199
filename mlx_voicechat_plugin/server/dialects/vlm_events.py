"""The mlx-vlm dialect's server events: the session objects, errors and the model's events.

Each is the event's object (a dict) wrapped as a typed message
(:mod:`..messages`); a model's audio is an :class:`~..messages.AudioOut`
whose PCM16 the transport writes into the event's ``delta``.

For the kinds the reference serializer has (``mlx_vlm/server/realtime.py``,
``_serialize_model_event``) the type names, field names and JSON types are
the reference's; ``conformance.wire`` diffs them field for field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...runtime.events import (
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
    TranscriptDone,
    UserTranscriptDelta,
)
from ..engine.commands import SessionDetails
from ..mcp.events import ServerToolCall, ToolOutput
from ..messages import AudioOut, JsonOut, Outgoing
from ..wire import ErrorCode, bounded, pcm16_bytes


def error_event(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"code": code, "message": bounded(message)}}


def audio_format(sample_rate: int) -> dict[str, Any]:
    return {"type": "pcm16", "sample_rate": sample_rate, "channels": 1}


def audio_formats(input_rate: int, output_rate: int) -> dict[str, Any]:
    return {"input_audio_format": audio_format(input_rate),
            "output_audio_format": audio_format(output_rate)}


def session_created(session_id: str, input_rate: int, output_rate: int) -> dict[str, Any]:
    return {"type": "session.created", "session": {
        "id": session_id, "state": "configuring", **audio_formats(input_rate, output_rate)}}


def session_updated(session_id: str, model: str, details: SessionDetails) -> dict[str, Any]:
    return {"type": "session.updated", "session": {
        "id": session_id, "state": "ready", "model": model,
        "frame_samples": details.frame_samples,
        "max_streaming_seconds": details.max_streaming_seconds,
        **audio_formats(details.input_sample_rate, details.output_sample_rate),
        **({"output_modalities": ["text"]} if details.text_only else {}),
    }}


def model_event(event: Event) -> dict[str, Any]:
    """A runtime event as its server event.

    Text and function deltas carry ``delta``/``text``, the user transcript
    ``delta``/``transcript``, audio its PCM16 in ``delta`` (left ``None`` here:
    :func:`message` carries the PCM beside it) with ``audio_codes``, as the
    reference's do.
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
        return {"type": "response.audio.delta", "delta": None,
                "format": "pcm16", "sample_rate": int(event.sample_rate), "channels": 1,
                "audio_codes": np.asarray(event.audio_codes).astype(int).tolist(), **index}
    if isinstance(event, Done):
        return {"type": "response.done", **index}
    if isinstance(event, Cancelled):
        return {"type": "response.cancelled", **index}
    if isinstance(event, ToolCall):
        run_by = {"server_label": event.server_label} if isinstance(event, ServerToolCall) else {}
        return {"type": "response.function_call_arguments.done", "call_id": event.call_id,
                "name": event.name, "arguments": event.arguments, **run_by, **index}
    if isinstance(event, ToolOutput):
        failed = {"error": {"type": event.failure, "message": event.message}} \
            if event.failure else {}
        return {"type": "conversation.item.function_call_output", "call_id": event.call_id,
                "name": event.name, "server_label": event.server_label,
                "output": event.output, **failed, **index}
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


def message(event: Event) -> Outgoing:
    """A runtime event as the message sent: audio apart from its event."""
    payload = model_event(event)
    if isinstance(event, Audio):
        return AudioOut(payload, "delta", pcm16_bytes(event.samples), "pcm16",
                        int(event.sample_rate))
    return JsonOut(payload)


def translate(events: list[Event]) -> list[Outgoing]:
    """Runtime events as the messages sent, in order (a failed server-run call: its
    output, then a ``tool_call_failed`` error)."""
    out = []
    for event in events:
        out.append(message(event))
        if isinstance(event, ToolOutput) and event.failure:
            out.append(JsonOut(tool_failed(event)))
    return out


def tool_failed(event: ToolOutput) -> dict[str, Any]:
    """The error event of a server-run call that failed: its type as ``reason``."""
    payload = error_event(ErrorCode.TOOL_CALL_FAILED, event.message)
    payload["error"].update(reason=event.failure, call_id=event.call_id, name=event.name,
                            frame_index=int(event.frame_index))
    return payload


def committed(events: list[Event], first_frame: int) -> list[Outgoing]:
    """A commit's events as the reference orders them: the audio of the frames run
    before it (frames below ``first_frame``: the last such frame's),
    ``input_audio_buffer.committed``, then the rest."""
    lead = 0
    while lead < len(events) and events[lead].frame_index < first_frame \
            and isinstance(events[lead], Audio):
        lead += 1
    return [*translate(events[:lead]), JsonOut({"type": "input_audio_buffer.committed"}),
            *translate(events[lead:])]
