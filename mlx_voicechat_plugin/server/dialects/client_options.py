"""A session's options from what its client asked for: built once, by its dialect, within
the server's bounds (on the event loop).

A dialect reads its ``session.update`` into values; :func:`session_options`
builds the runtime's :class:`ConversationOptions` from them (its checks are the
only ones the values get) and the engine's open carries that object. A bad
value is the client's ``session_initialization_failed``, its message naming
the client's field and the limit. The server's bounds apply here:
``--max-session-seconds`` caps ``max_streaming_seconds``, and
``--max-prompt-tokens`` and ``--max-transcript-bytes`` are set, and
``--context-seconds`` is a session's bounded context (a client may ask for a
shorter one); ``--temperature`` / ``--top-p`` are the sampling of a session
whose client sets none.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from ...runtime.options import ConversationOptions, TranscriptionOptions
from ..limits import ServerLimits
from ..wire import init_failed


def client_fields(message: str, fields: Mapping[str, str]) -> str:
    """An option's error message naming the client's field (``fields``: option -> field)."""
    for option, name in fields.items():
        if message.startswith(option + " "):
            return name + message[len(option):]
    return message


def session_options(limits: ServerLimits, fields: Mapping[str, str],
                    **values: Any) -> ConversationOptions:
    """The session's options from the client's ``values`` (``fields`` names them)."""
    values.setdefault("context_seconds", None)
    for name in ("temperature", "top_p"):
        if values.get(name) is None:
            values[name] = getattr(limits, name)
    try:
        options = ConversationOptions(max_prompt_tokens=limits.max_prompt_tokens, **values)
    except (TypeError, ValueError) as exc:
        raise init_failed(client_fields(str(exc), fields)) from None
    return replace(options, max_streaming_seconds=streaming_seconds(
        limits, options.max_streaming_seconds), context_seconds=context_seconds(
        limits, options.context_seconds))


def context_seconds(limits: ServerLimits, requested: float | None) -> float | None:
    """A session's ``context_seconds``: the request (unset: the server's), at most the
    server's bound (``--context-seconds``; a client cannot ask for an unbounded one)."""
    if requested is None:
        return limits.context_seconds
    return requested if limits.context_seconds is None else min(requested, limits.context_seconds)


def streaming_seconds(limits: ServerLimits, requested: float | None) -> float:
    """A session's ``max_streaming_seconds``: the request, at most the server's cap."""
    if requested is None:
        return float(limits.max_session_seconds)
    return float(min(requested, limits.max_session_seconds))


def transcription_options(limits: ServerLimits,
                          options: ConversationOptions) -> TranscriptionOptions:
    """A text-only session's options: the bound of ``options``, the server's transcript cap."""
    return TranscriptionOptions(max_streaming_seconds=options.max_streaming_seconds,
                                max_transcript_bytes=limits.max_transcript_bytes)
