"""A full-duplex timeline as OpenAI Realtime GA responses and conversation items.

The model listens and speaks in every 80 ms frame; GA clients think in
responses. The mapping, one frame's runtime events at a time:

- Assistant: one utterance is one response. A response opens at a request
  (``response.create``: ``response.created`` at once; ``commit`` with turn
  detection off: owed, announced when the model speaks or the bound ends it)
  or at the model's first visible text token; that token opens its message
  (``response.output_item.added`` -> ``conversation.item.added`` ->
  ``response.content_part.added``). Its text tokens are
  ``response.output_audio_transcript.delta`` (``output_text`` with
  ``output_modalities: ["text"]``) and its frames' audio, resampled to the
  client's format, ``response.output_audio.delta``. Audio between responses
  is the model's silence and is not sent.
- Every ``response.created`` is followed by its ``response.done`` (the
  ``.done`` events of what it opened first, then ``usage``: text tokens and
  audio frames, measured), with status ``completed`` when the model's turn
  ends: its end-of-turn token (the text channel's EOS, :class:`TurnEnded`),
  after the audio of that frame and :data:`TAIL_FRAMES` more; or no visible
  text for :data:`RESPONSE_GAP_SECONDS` once it spoke (a checkpoint that never
  emits EOS); or a tool call; or the end of the stream. ``incomplete``
  (reason ``max_output_tokens``) when ``max_response_seconds`` of timeline
  passed since it opened; ``cancelled`` (``client_cancelled``) at
  ``response.cancel`` / ``conversation.item.truncate`` or when a new prompt
  restarts the timeline. While a response is owed (:attr:`GAResponses.owes`)
  the connection runs the timeline on silence if the client sends no audio;
  text in those frames after the owed response ended opens no new one (else a
  model that never stops would keep the server running silence for ever).
- A tool call is a ``function_call`` output item of the response it ends:
  ``response.output_item.added`` -> ``conversation.item.added`` ->
  ``response.function_call_arguments.delta``/``done`` ->
  ``conversation.item.done`` -> ``response.output_item.done``.
- User: the transcript channel's tokens are one user item's
  ``conversation.item.input_audio_transcription.delta``; with turn detection
  on, its first token is ``input_audio_buffer.speech_started`` and a pause of
  ``silence_duration_ms`` ``speech_stopped`` -> ``committed`` -> the item ->
  ``...transcription.completed`` (without it, the client's commit ends the item).
- ``response.cancel`` ends the current response as ``cancelled`` and drops the
  rest of that utterance (until its EOS or a pause). ``response.create``
  cannot make the model speak: it opens a response, with its ``metadata``,
  that the model's next utterance fills (or that ends empty at the bound).
  While one is active (e.g. the model began speaking on its own just before),
  the request waits and its response opens the moment the active one is done,
  so a client that asked always gets a ``response.created`` with its
  ``metadata``; a second request while one waits is refused
  (``conversation_already_has_active_response``).

:meth:`GAResponses.translate` and the request methods all run on the
connection's event loop (the engine hands the runtime events over there), so
the state has one thread and no lock.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...runtime.events import (
    AssistantTextDelta,
    Audio,
    Cancelled,
    Done,
    Event,
    ToolCall,
    ToolCallInvalid,
    TurnEnded,
    UserTranscriptDelta,
)
from ...runtime.transcribe import TranscriptDone
from ..wire import dumps, new_id
from . import ga_items
from .ga_audio import OutputAudio
from .ga_session import GAConfig, error_event

logger = logging.getLogger(__name__)

RESPONSE_GAP_SECONDS = 0.8  # a response ends after this long without a text token
# Frames of audio a response keeps after its EOS frame: the speech channel
# lags the text by up to ``num_delay_speech_tokens`` (2) frames.
TAIL_FRAMES = 2
MAX_CALL_ID_CHARS = 32  # GA's cap on call_id (clients shorten longer ones by hashing)


@dataclass
class _Message:
    id: str
    output_index: int
    text: str = ""


@dataclass
class _Response:
    id: str
    first_frame: int  # usage and the bound count from here
    last_text_frame: int
    last_frame: int  # the bound: the response ends (incomplete) past this frame
    metadata: Any = None
    announced: bool = False  # response.created was sent
    spoke: bool = False  # a visible text token came
    end_frame: int | None = None  # the frame of the model's end-of-turn token
    message: _Message | None = None
    output: list[dict[str, Any]] = field(default_factory=list)
    text_tokens: int = 0
    audio_frames: int = 0
    audio: OutputAudio | None = None


@dataclass
class _UserItem:
    id: str
    first_frame: int
    last_frame: int
    text: str = ""


class GAResponses:
    """The state of one GA session's conversation: its open response and user item."""

    def __init__(self, config: GAConfig, model_rate: int = 22_050,
                 frame_seconds: float = 0.08):
        self.config = config
        self.model_rate, self.frame_seconds = model_rate, frame_seconds
        self.response: _Response | None = None
        self.user: _UserItem | None = None
        self.last_item_id: str | None = None
        self.items: set[str] = set()
        self.calls: dict[str, str] = {}  # GA call_id -> the runtime's call_id
        self.failure: str | None = None  # the message of a response ending as failed
        # The frames now translated are the server's silence (an owed response's
        # continuation), not client audio: they open no new response.
        self.server_frames = False
        self.muted_since: int | None = None  # a cancelled utterance's last text frame
        self.frame = 0  # the latest frame seen
        self.ended = False  # the stream ended (Done / Cancelled)
        self.waiting: list[Any] = []  # a response.create's metadata, while one is active

    def configure(self, config: GAConfig, model_rate: int | None = None,
                  frame_seconds: float | None = None) -> None:
        self.config = config
        self.model_rate = model_rate or self.model_rate
        self.frame_seconds = frame_seconds or self.frame_seconds

    # --- helpers ----------------------------------------------------------

    def _frames(self, seconds: float) -> int:
        return max(1, math.ceil(seconds / self.frame_seconds - 1e-9))

    def _ms(self, frame: int) -> int:
        return int(round(frame * self.frame_seconds * 1000))

    @property
    def _audio_out(self) -> bool:
        return "audio" in self.config.output_modalities

    def _add_item(self, item: dict[str, Any], out: list[dict[str, Any]], kind: str) -> None:
        out.append({"type": kind, "previous_item_id": self.last_item_id, "item": item})
        if kind == "conversation.item.added":
            self.last_item_id = item["id"]
            self.items.add(item["id"])

    # --- one frame's events ---------------------------------------------------

    def translate(self, events: list[Event]) -> list[str]:
        out: list[dict[str, Any]] = []
        for event in events:
            self._event(event, out)
        return [dumps(payload) for payload in out]

    def _event(self, event: Event, out: list[dict[str, Any]]) -> None:
        self.frame = max(self.frame, int(event.frame_index))
        if isinstance(event, Audio):
            self._audio(event, out)
        elif isinstance(event, AssistantTextDelta):
            self._text(event, out)
        elif isinstance(event, UserTranscriptDelta):
            self._user(event, out)
        elif isinstance(event, ToolCall):
            self._tool_call(event, out)
        elif isinstance(event, ToolCallInvalid):
            out.append(error_event(event.code, event.message))
        elif isinstance(event, TranscriptDone):  # a text-only stream's end: its last item
            self._close_user(out, stopped=True)
        elif isinstance(event, TurnEnded):
            self._turn_ended(int(event.frame_index))
        elif isinstance(event, (Done, Cancelled)):
            self._close_user(out, stopped=True)
            self.ended = True
            if self.response is not None:
                self._finish(out, "completed" if isinstance(event, Done) else "cancelled")
        # FunctionDelta, ToolResultInjected, ToolsWarning: no GA counterpart.

    def _audio(self, event: Audio, out: list[dict[str, Any]]) -> None:
        frame = int(event.frame_index)
        user = self.user
        if user is not None and self.config.turn_detection is not None and \
                frame - user.last_frame >= self._frames(self.config.silence_ms / 1000):
            self._close_user(out, stopped=True)
        gap = self._frames(RESPONSE_GAP_SECONDS)
        if self.muted_since is not None and frame - self.muted_since >= gap:
            self.muted_since = None
        response = self.response
        if response is None:
            return
        if response.spoke and response.end_frame is None \
                and frame - response.last_text_frame >= gap:
            self._finish(out, "completed")
            return
        if self._audio_out and response.message is not None:
            response.audio_frames += 1
            delta = response.audio(event.samples)
            if delta:
                out.append({"type": "response.output_audio.delta", **self._part(response),
                            "delta": delta})
        if response.end_frame is not None and frame >= response.end_frame + TAIL_FRAMES:
            self._finish(out, "completed")
        elif frame >= response.last_frame:
            self._finish(out, "incomplete")

    def _turn_ended(self, frame: int) -> None:
        """The model's end-of-turn token: its response ends after the tail's audio."""
        if self.muted_since is not None:
            self.muted_since = None  # the cancelled utterance is over
            return
        response = self.response
        if response is not None and response.spoke and response.end_frame is None:
            response.end_frame = frame

    def _text(self, event: AssistantTextDelta, out: list[dict[str, Any]]) -> None:
        frame = int(event.frame_index)
        if self.muted_since is not None:
            self.muted_since = frame
            return
        if self.response is None:
            if self.server_frames:
                return  # the server's silence was for an answer that has ended
            self._start(out, frame)
        response = self.response
        self._announce(out)
        if response.message is None:
            self._start_message(out)
        response.spoke = True
        response.end_frame = None  # it speaks on after an EOS: the turn goes on
        response.last_text_frame = frame
        response.text_tokens += 1
        response.message.text += event.delta
        kind = "response.output_audio_transcript.delta" if self._audio_out \
            else "response.output_text.delta"
        out.append({"type": kind, **self._part(response), "delta": event.delta})

    def _tool_call(self, event: ToolCall, out: list[dict[str, Any]]) -> None:
        if self.response is None:
            self._start(out, int(event.frame_index))
        response = self.response
        self._announce(out)
        self._close_message(out)
        item_id = new_id("item")
        index = len(response.output)
        call_id = "call_" + event.call_id.removeprefix("call_")[: MAX_CALL_ID_CHARS - 5]
        self.calls[call_id] = event.call_id
        item = ga_items.function_call(item_id, call_id, event.name)
        where = {"response_id": response.id, "item_id": item_id, "output_index": index,
                 "call_id": call_id}
        out.append({"type": "response.output_item.added", "response_id": response.id,
                    "output_index": index, "item": item})
        self._add_item(item, out, "conversation.item.added")
        out.append({"type": "response.function_call_arguments.delta", **where,
                    "delta": event.arguments})
        out.append({"type": "response.function_call_arguments.done", **where,
                    "name": event.name, "arguments": event.arguments})
        done = ga_items.function_call(item_id, call_id, event.name, event.arguments,
                                      "completed")
        self._add_item(done, out, "conversation.item.done")
        out.append({"type": "response.output_item.done", "response_id": response.id,
                    "output_index": index, "item": done})
        response.output.append(done)
        self._finish(out, "completed")  # the client runs the tool now

    def _user(self, event: UserTranscriptDelta, out: list[dict[str, Any]]) -> None:
        frame = int(event.frame_index)
        if self.user is None:
            self.user = _UserItem(new_id("item"), frame, frame)
            if self.config.turn_detection is not None:
                out.append({"type": "input_audio_buffer.speech_started",
                            "audio_start_ms": self._ms(frame), "item_id": self.user.id})
        self.user.last_frame = frame
        self.user.text += event.delta  # event.text is the whole session's transcript
        out.append({"type": "conversation.item.input_audio_transcription.delta",
                    "item_id": self.user.id, "content_index": 0, "delta": event.delta})

    # --- responses -------------------------------------------------------

    def _start(self, out: list[dict[str, Any]] | None, frame: int,
               metadata: Any = None) -> None:
        """A new response from ``frame``; announced now unless ``out`` is ``None``."""
        bound = self._frames(self.config.max_response_seconds)
        response = _Response(new_id("resp"), frame, frame, frame + bound - 1,
                             metadata=metadata)
        response.audio = OutputAudio(self.config.output_format, self.model_rate)
        self.response = response
        if out is not None:
            self._announce(out)

    def _announce(self, out: list[dict[str, Any]]) -> None:
        response = self.response
        if not response.announced:
            response.announced = True
            out.append({"type": "response.created",
                        "response": self._response_object(response)})

    def _start_message(self, out: list[dict[str, Any]]) -> None:
        response = self.response
        message = _Message(new_id("item"), len(response.output))
        response.message = message
        item = ga_items.assistant_message(message.id)
        out.append({"type": "response.output_item.added", "response_id": response.id,
                    "output_index": message.output_index, "item": item})
        self._add_item(item, out, "conversation.item.added")
        out.append({"type": "response.content_part.added", **self._part(response),
                    "part": ga_items.content_part(self._audio_out, "")})

    def _part(self, response: _Response) -> dict[str, Any]:
        return {"response_id": response.id, "item_id": response.message.id,
                "output_index": response.message.output_index, "content_index": 0}

    def _close_message(self, out: list[dict[str, Any]], status: str = "completed") -> None:
        response = self.response
        message = response.message if response is not None else None
        if message is None:
            return
        where = self._part(response)
        if self._audio_out:
            tail = response.audio(np.zeros(0, np.float32), last=True)  # the resampler's tail
            if tail:
                out.append({"type": "response.output_audio.delta", **where, "delta": tail})
            out.append({"type": "response.output_audio.done", **where})
            out.append({"type": "response.output_audio_transcript.done", **where,
                        "transcript": message.text})
        else:
            out.append({"type": "response.output_text.done", **where, "text": message.text})
        out.append({"type": "response.content_part.done", **where,
                    "part": ga_items.content_part(self._audio_out, message.text)})
        item = ga_items.assistant_message(
            message.id, "completed" if status == "completed" else "incomplete",
            [ga_items.message_content(self._audio_out, message.text)])
        self._add_item(item, out, "conversation.item.done")
        out.append({"type": "response.output_item.done", "response_id": response.id,
                    "output_index": message.output_index, "item": item})
        response.output.insert(message.output_index, item)
        response.message = None

    def _finish(self, out: list[dict[str, Any]], status: str) -> None:
        self._announce(out)
        self._close_message(out, status)
        response = self.response
        self.response = None
        body = self._response_object(response, status)
        out.append({"type": "response.done", "response": body})
        if self.waiting:  # the request that waited opens its response
            self._start(out, self.frame + 1, metadata=self.waiting.pop())
            if self.ended:  # the stream is over: that response ends at once
                self._finish(out, "cancelled")

    def _response_object(self, response: _Response, status: str = "in_progress") -> dict:
        usage = None
        if status != "in_progress":
            heard = max(self.frame - response.first_frame + 1, 0)
            usage = ga_items.usage(heard, response.text_tokens, response.audio_frames)
        return ga_items.response_object(response.id, self.config, response.output,
                                        response.metadata, status, usage, self.failure)

    # --- the user item -------------------------------------------------------

    def _close_user(self, out: list[dict[str, Any]], stopped: bool) -> str:
        """End the user's item (``committed`` and the item); its id, or a new one if none."""
        user = self.user
        self.user = None
        if user is None:
            return new_id("item")
        if stopped and self.config.turn_detection is not None:
            out.append({"type": "input_audio_buffer.speech_stopped",
                        "audio_end_ms": self._ms(user.last_frame + 1), "item_id": user.id})
        out.append({"type": "input_audio_buffer.committed",
                    "previous_item_id": self.last_item_id, "item_id": user.id})
        item = ga_items.user_message(user.id, user.text)
        self._add_item(item, out, "conversation.item.added")
        self._add_item(item, out, "conversation.item.done")
        out.append({"type": "conversation.item.input_audio_transcription.completed",
                    "item_id": user.id, "content_index": 0, "transcript": user.text})
        return user.id

    # --- client requests ---------------------------------------------------------

    @property
    def owes(self) -> bool:
        """A response is open or owed: the timeline must run until it ends."""
        return self.response is not None

    def commit(self) -> list[dict[str, Any]]:
        """``input_audio_buffer.commit``: the user item so far is committed; with
        turn detection off a response is owed (announced when the model speaks)."""
        out: list[dict[str, Any]] = []
        if self.user is None:
            item_id = new_id("item")
            out.append({"type": "input_audio_buffer.committed",
                        "previous_item_id": self.last_item_id, "item_id": item_id})
        else:
            self._close_user(out, stopped=False)
        if self.config.turn_detection is None and self.response is None \
                and self._audio_out and not self.ended:
            self._start(None, self.frame + 1)
        return out

    def cancel(self) -> list[dict[str, Any]] | None:
        """``response.cancel``: the response's events, or ``None`` when none is active.
        The rest of the utterance (until its EOS or a pause) is not sent."""
        if self.response is None:
            return None
        out: list[dict[str, Any]] = []
        self.muted_since = max(self.response.last_text_frame, self.frame)
        self._finish(out, "cancelled")
        return out

    def truncate(self, item_id: str) -> list[dict[str, Any]] | None:
        """``conversation.item.truncate``: cancels the response still speaking ``item_id``;
        ``None`` for an unknown item."""
        response = self.response
        speaking = response is not None and response.message is not None \
            and response.message.id == item_id
        if not speaking and item_id not in self.items:
            return None
        if speaking:
            return self.cancel() or []
        return []

    def fail(self, message: str) -> list[dict[str, Any]]:
        """The timeline could not run: the owed response ends as ``failed``."""
        out: list[dict[str, Any]] = []
        if self.response is not None:
            self.failure = message
            self._finish(out, "failed")
            self.failure = None
        return out

    def restart(self) -> list[dict[str, Any]]:
        """A new engine timeline: the open response and user item end, frames count anew."""
        out: list[dict[str, Any]] = []
        if self.response is not None:
            self._finish(out, "cancelled")
        self._close_user(out, stopped=False)
        self.frame, self.muted_since, self.ended = 0, None, False
        return out

    def runtime_call_id(self, call_id: str) -> str:
        """The runtime's id of a call announced as ``call_id`` (unknown ids pass through)."""
        return self.calls.get(call_id, call_id)

    def request(self, response: Any) -> list[dict[str, Any]] | None:
        """``response.create``: ``response.created`` now (the model's next utterance fills
        it), or for an owed, unannounced one; while one is active, nothing yet (its
        response opens when the active one is done); ``None`` when a request already
        waits or the stream has ended."""
        metadata = response.get("metadata") if isinstance(response, dict) else None
        out: list[dict[str, Any]] = []
        if self.response is None:
            if self.ended:
                return None
            self._start(None, self.frame + 1)
        elif self.response.announced:
            if self.waiting or self.ended:
                return None
            self.waiting.append(metadata)
            return out
        self.response.metadata = metadata
        self._announce(out)
        return out

    @property
    def active_response_id(self) -> str | None:
        return None if self.response is None else self.response.id

    def item_added(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A client-created item (a tool result): ``conversation.item.added`` / ``done``."""
        out: list[dict[str, Any]] = []
        self._add_item(item, out, "conversation.item.added")
        self._add_item(item, out, "conversation.item.done")
        return out

