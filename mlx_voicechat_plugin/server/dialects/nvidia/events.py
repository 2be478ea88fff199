"""The NVIDIA VoiceChat dialect's server events: one session's output, turns and counters.

:class:`Conversation` turns a session's runtime events into NVIDIA's
events (``docs/api.md`` of NeMo-Speech.cpp, "VoiceChat WebSocket
/v1/realtime"): the model's audio resampled to 24 kHz and cut into
``response.output_audio.delta`` packets of exactly 80 ms (1,920 samples,
silence included), ``response.created`` and the output item and part
events at the first output, the assistant transcript per turn, the user's
turn (``speech_started``, transcription deltas, ``completed``,
``speech_stopped``), tool calls, and the ``session.end`` counters. Only the
session's event loop touches it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....runtime.events import (
    AssistantTextDelta, Audio, ToolCall, ToolCallInvalid, TurnEnded, UserTranscriptDelta,
)
from ...mcp.events import ToolOutput
from ...messages import AudioOut, JsonOut, Outgoing
from ...wire import new_id, pcm16_bytes
from ..ga.audio import Resampler

logger = logging.getLogger(__name__)

OUTPUT_RATE = 24_000
PACKET_SAMPLES = OUTPUT_RATE * 80 // 1000  # 1,920 samples: 80 ms
PACKET_BYTES = PACKET_SAMPLES * 2
# Frames (80 ms each) with no new user transcript after which the user's turn ends.
USER_PAUSE_FRAMES = 8
AUDIBLE = 328  # PCM16 peak (1% of full scale) from which an output packet is not silence


def error_event(kind: str, code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "code": code, "message": message}}


@dataclass
class Counters:
    """What ``session.end`` reports; each counts what happened. With ``metrics`` (the
    engine's :class:`~..engine.client_metrics.ClientMetrics`) ``/metrics`` counts it too."""

    chunks_received: int = 0  # audio messages (binary or base64) received
    chunks_dropped: int = 0  # of them, refused (bad audio) or lost to a failed frame
    chunks_sent: int = 0  # output packets sent
    inferences: int = 0  # model frames stepped
    input_rate: int = OUTPUT_RATE
    metrics: Any = None
    dialect: str = "nvidia"

    def received(self, samples: int) -> None:
        """``samples`` of input accepted, at the client's rate (the session counts them:
        :attr:`~...session.session.Session.samples_received`; ``/metrics`` here)."""
        if self.metrics is not None:
            self.metrics.received.labels(self.dialect).inc(samples / self.input_rate)

    def dropped(self) -> None:
        self.chunks_dropped += 1
        if self.metrics is not None:
            self.metrics.dropped.labels(self.dialect).inc()

    def sent(self) -> None:
        self.chunks_sent += 1
        if self.metrics is not None:
            self.metrics.sent.labels(self.dialect).inc(PACKET_SAMPLES / OUTPUT_RATE)

    def stepped(self) -> None:
        self.inferences += 1
        if self.metrics is not None:
            self.metrics.stepped.labels(self.dialect).inc()

    def answered(self, seconds: float) -> None:
        """The first non-silent output came ``seconds`` after the user stopped."""
        if self.metrics is not None:
            self.metrics.latency.labels(self.dialect).observe(seconds)

    def stats(self, samples_received: int) -> dict[str, Any]:
        """The counters, with the input the session took (``samples_received``)."""
        return {"chunks_received": self.chunks_received, "chunks_sent": self.chunks_sent,
                "chunks_dropped": self.chunks_dropped, "triton_inferences": self.inferences,
                "inferences": self.inferences,
                "audio_duration_received_s": round(samples_received / self.input_rate, 3)}


class Conversation:
    """One session's output: the response, the turns and the packets."""

    def __init__(self, model_rate: int, counters: Counters):
        self.counters = counters
        self.resample = Resampler(model_rate, OUTPUT_RATE)
        self.pending = bytearray()  # 24 kHz PCM16 not yet a whole packet
        self.response_id = new_id("resp")
        self.item_id = new_id("item")
        self.announced = False
        self.agent_text = ""  # the assistant's turn so far
        self.user_item: str | None = None  # the user's turn, while it lasts
        self.user_text = ""
        self.user_quiet = 0
        self.user_spoke_at: float | None = None  # the last user word (monotonic)
        self.awaiting: float | None = None  # the user stopped then; no audible answer yet
        self.frames = 0

    # --- the response ------------------------------------------------------------------

    def _ids(self) -> dict[str, Any]:
        return {"response_id": self.response_id, "item_id": self.item_id,
                "output_index": 0, "content_index": 0}

    def _item(self, status: str) -> dict[str, Any]:
        part = {"type": "output_audio", "transcript": self.agent_text}
        return {"id": self.item_id, "object": "realtime.item", "type": "message",
                "role": "assistant", "status": status, "content": [part]}

    def _response(self, status: str) -> dict[str, Any]:
        output = [self._item(status)] if status != "in_progress" else []
        return {"id": self.response_id, "object": "realtime.response", "status": status,
                "output": output}

    def announce(self, out: list[Outgoing]) -> None:
        if self.announced:
            return
        self.announced = True
        out.append(JsonOut({"type": "response.created", "response": self._response("in_progress")}))
        out.append(JsonOut({"type": "response.output_item.added", "response_id": self.response_id,
                          "output_index": 0, "item": self._item("in_progress")}))
        out.append(JsonOut({"type": "response.content_part.added", **self._ids(),
                          "part": {"type": "output_audio", "transcript": ""}}))

    def packets(self, out: list[Outgoing], last: bool = False) -> None:
        """Whole 80 ms packets of the pending audio (the rest padded with silence if
        ``last``)."""
        if last and len(self.pending) % PACKET_BYTES:
            self.pending.extend(bytes(PACKET_BYTES - len(self.pending) % PACKET_BYTES))
        while len(self.pending) >= PACKET_BYTES:
            self.announce(out)
            data = bytes(self.pending[:PACKET_BYTES])
            del self.pending[:PACKET_BYTES]
            event = {"type": "response.output_audio.delta", **self._ids(), "delta": None}
            out.append(AudioOut(event, "delta", data, "pcm16", OUTPUT_RATE))
            self.counters.sent()
            self.packet_out(data)

    # --- the turns -----------------------------------------------------------------------

    def user_delta(self, event: UserTranscriptDelta, out: list[Outgoing]) -> None:
        if self.user_item is None:
            self.user_item, self.user_text = new_id("item"), ""
            out.append(JsonOut({"type": "input_audio_buffer.speech_started",
                              "item_id": self.user_item,
                              "audio_start_ms": int(event.frame_index) * 80}))
        self.user_quiet = 0
        self.user_spoke_at, self.awaiting = time.monotonic(), None
        self.user_text += event.delta
        out.append(JsonOut({"type": "conversation.item.input_audio_transcription.delta",
                          "item_id": self.user_item, "content_index": 0,
                          "delta": event.delta}))

    def end_user_turn(self, out: list[Outgoing]) -> None:
        if self.user_item is None:
            return
        out.append(JsonOut({"type": "conversation.item.input_audio_transcription.completed",
                          "item_id": self.user_item, "content_index": 0,
                          "transcript": self.user_text}))
        out.append(JsonOut({"type": "input_audio_buffer.speech_stopped",
                          "item_id": self.user_item, "audio_end_ms": self.frames * 80}))
        self.user_item, self.user_text = None, ""
        self.awaiting = self.user_spoke_at

    def packet_out(self, packet: bytes) -> None:
        """A packet went out: the first audible one after the user stopped is the answer."""
        if self.awaiting is None:
            return
        if np.abs(np.frombuffer(packet, "<i2")).max() >= AUDIBLE:
            self.counters.answered(time.monotonic() - self.awaiting)
            self.awaiting = None

    def agent_delta(self, event: AssistantTextDelta, out: list[Outgoing]) -> None:
        self.end_user_turn(out)
        self.announce(out)
        self.agent_text += event.delta
        out.append(JsonOut({"type": "response.output_audio_transcript.delta", **self._ids(),
                          "delta": event.delta}))

    def end_agent_turn(self, out: list[Outgoing]) -> None:
        if not self.agent_text:
            return
        self.announce(out)
        out.append(JsonOut({"type": "response.output_audio_transcript.done", **self._ids(),
                          "transcript": self.agent_text}))
        self.agent_text = ""

    # --- runtime events ---------------------------------------------------------------

    def translate(self, events: list) -> list[Outgoing]:
        out: list[Outgoing] = []
        for event in events:
            if isinstance(event, Audio):
                self.frames += 1
                self.counters.stepped()
                self.pending.extend(pcm16_bytes(self.resample(np.asarray(event.samples))))
                self.packets(out)
                if self.user_item is not None:
                    self.user_quiet += 1
                    if self.user_quiet >= USER_PAUSE_FRAMES:
                        self.end_user_turn(out)
            elif isinstance(event, AssistantTextDelta):
                self.agent_delta(event, out)
            elif isinstance(event, TurnEnded):
                self.end_agent_turn(out)
            elif isinstance(event, UserTranscriptDelta):
                self.user_delta(event, out)
            elif isinstance(event, ToolCall):
                out.append(JsonOut({"type": "response.function_call_arguments.done",
                                  "response_id": self.response_id, "item_id": new_id("item"),
                                  "call_id": event.call_id, "name": event.name,
                                  "arguments": event.arguments}))
            elif isinstance(event, ToolCallInvalid):
                logger.info("tool call refused (%s): %s", event.reason, event.message)
            elif isinstance(event, ToolOutput):  # a call the server ran ended
                out.append(JsonOut({"type": "conversation.item.function_call_output",
                                    "response_id": self.response_id, "call_id": event.call_id,
                                    "name": event.name, "output": event.output}))
                if event.failure:
                    error = error_event("tool_error", "tool_call_failed",
                                        f"{event.failure}: {event.message}")
                    error["error"].update(call_id=event.call_id, reason=event.failure)
                    out.append(JsonOut(error))
        return out

    def finish(self) -> list[Outgoing]:
        """The end of the stream: the last packet, the open turns, the response's end."""
        out: list[Outgoing] = []
        tail = self.resample(np.zeros(0, np.float32), last=True)
        self.pending.extend(pcm16_bytes(tail))
        self.packets(out, last=True)
        self.end_user_turn(out)
        if not self.announced:
            return out
        text = self.agent_text
        self.end_agent_turn(out)
        self.agent_text = text
        out.append(JsonOut({"type": "response.output_audio.done", **self._ids()}))
        out.append(JsonOut({"type": "response.content_part.done", **self._ids(),
                          "part": {"type": "output_audio", "transcript": text}}))
        out.append(JsonOut({"type": "response.output_item.done", "response_id": self.response_id,
                          "output_index": 0, "item": self._item("completed")}))
        out.append(JsonOut({"type": "response.done", "response": self._response("completed")}))
        return out
