"""One GPT-Live session's output: the runtime's events on the session timeline.

The timeline counts from the engine session's open, 80 ms a frame: a transcript
fragment of frame ``f`` spans ``[f * 80, (f + 1) * 80)`` ms
(``session.input_transcript.delta`` for the user, ``session.output_transcript.delta``
for the model); every frame's speech goes out as ``session.output_audio.delta`` in the
session's format (the model speaks and listens at once, so its audio is one stream, not
responses); a tool call is a delegation (:mod:`.delegations`); every
:data:`USAGE_EVERY_SECONDS` of timeline ``session.usage.updated`` reports the whole
seconds so far and, when the context is bounded (``--context-seconds``), the share of
it the conversation fills.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ....runtime.events import (AssistantTextDelta, Audio, ToolCall, ToolCallInvalid,
                                UserTranscriptDelta)
from ...messages import AudioOut, JsonOut, Outgoing
from ..ga.audio import AudioFormat, OutputAudio
from .delegations import Delegations

logger = logging.getLogger(__name__)

FRAME_MS = 80
USAGE_EVERY_SECONDS = 2


def usage(seconds: float, context_seconds: float | None) -> dict[str, Any]:
    """``session.usage.updated``'s fields: whole seconds, and the bounded context's share."""
    out: dict[str, Any] = {"usage": {"seconds": float(int(seconds))}}
    if context_seconds:
        out["context_window"] = {"usage_ratio": round(min(1.0, seconds / context_seconds), 4)}
    return out


class LiveTimeline:
    """The session's events since its engine session opened (frames count from there)."""

    def __init__(self, fmt: AudioFormat, model_rate: int, delegations: Delegations,
                 context_seconds: float | None):
        self.audio = OutputAudio(fmt, model_rate)
        self.delegations = delegations
        self.context_seconds = context_seconds
        self.frames = 0  # frames run since the open
        self.reported = 0  # whole seconds last reported

    @property
    def ms(self) -> int:
        return self.frames * FRAME_MS

    @property
    def seconds(self) -> float:
        return self.frames * FRAME_MS / 1000

    def usage(self) -> dict[str, Any]:
        return usage(self.seconds, self.context_seconds)

    def translate(self, events: list) -> list[Outgoing]:
        out: list[Outgoing] = []
        for event in events:
            if isinstance(event, Audio):
                self.frames = max(self.frames, int(event.frame_index) + 1)
                data = self.audio.encoded(np.asarray(event.samples))
                if data:
                    fmt = self.audio.format
                    out.append(AudioOut({"type": "session.output_audio.delta", "delta": None},
                                        "delta", data, fmt.type, fmt.rate))
                if self.seconds >= self.reported + USAGE_EVERY_SECONDS:
                    self.reported = int(self.seconds)
                    out.append(JsonOut({"type": "session.usage.updated", **self.usage()}))
            elif isinstance(event, (UserTranscriptDelta, AssistantTextDelta)):
                start = int(event.frame_index) * FRAME_MS
                kind = "session.input_transcript.delta" if isinstance(
                    event, UserTranscriptDelta) else "session.output_transcript.delta"
                out.append(JsonOut({"type": kind, "delta": event.delta, "start_ms": start,
                                    "end_ms": start + FRAME_MS}))
            elif isinstance(event, ToolCall):
                offset = int(event.frame_index) * FRAME_MS
                out.extend(JsonOut(e) for e in self.delegations.delegate(event, offset))
            elif isinstance(event, ToolCallInvalid):
                logger.info("tool call refused (%s): %s", event.reason, event.message)
        return out

    def tail(self) -> list[Outgoing]:
        """The resampler's last samples (the stream's end)."""
        data = self.audio.encoded(np.zeros(0, np.float32), last=True)
        if not data:
            return []
        fmt = self.audio.format
        return [AudioOut({"type": "session.output_audio.delta", "delta": None}, "delta", data,
                         fmt.type, fmt.rate)]
