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
  the session's timer runs the timeline on silence if the client sends no audio;
  text in those frames after the owed response ended opens no new one (else a
  model that never stops would keep the server running silence for ever).
- ``response.done`` carries this server's extension, a top-level
  ``voicechat`` object GA clients ignore: how late the engine ran the frames
  stepped while the response was open (``frames``, ``late_frames``: steps
  slower than a frame of wall time, ``max_late_ms``; :mod:`..engine.pace`),
  and the same for the whole session so far (``session``).
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

What :class:`GAResponses` keeps is :mod:`.records`'.
:meth:`GAResponses.translate` and the request methods all run on the
session's event loop (the engine hands the runtime events over there), so
the state has one thread and no lock.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from ....runtime.events import (
    AssistantTextDelta,
    Audio,
    Cancelled,
    Done,
    Event,
    ToolCall,
    ToolCallInvalid,
    TranscriptDone,
    TurnEnded,
    UserTranscriptDelta,
)
from ...mcp.events import ApprovalRequest, ServerToolCall, ToolOutput
from ...engine.pace import FramePace
from ...limits import ServerLimits
from ...messages import AudioOut, JsonOut, Outgoing
from ...wire import ProtocolError, invalid, new_id
from . import items as ga_items
from . import mcp_calls, mcp_tools
from .audio import OutputAudio
from .config import GAConfig, error_event
from .records import ItemStore, Message, Out, Response, UserItem

logger = logging.getLogger(__name__)

RESPONSE_GAP_SECONDS = 0.8  # a response ends after this long without a text token
# Frames of audio a response keeps after its EOS frame: the speech channel
# lags the text by up to ``num_delay_speech_tokens`` (2) frames.
TAIL_FRAMES = 2
MAX_CALL_ID_CHARS = 32  # GA's cap on call_id (clients shorten longer ones by hashing)


def outgoing(out: Out) -> list[Outgoing]:
    """A step's output as the messages sent: each event typed, audio already apart."""
    return [item if isinstance(item, AudioOut) else JsonOut(item) for item in out]


class GAResponses:
    """One GA session's conversation: its open response and user item, how each opens and
    closes (the events of each step), and which step a runtime event or request takes."""

    def __init__(self, config: GAConfig, model_rate: int = 22_050,
                 frame_seconds: float = 0.08, max_item_bytes: int = ServerLimits.max_item_bytes):
        self.config = config
        self.model_rate, self.frame_seconds = model_rate, frame_seconds
        self.response: Response | None = None
        self.user: UserItem | None = None
        self.last_item_id: str | None = None
        # The items as last sent (``conversation.item.retrieve``), oldest first.
        self.items = ItemStore(max_item_bytes)
        self.user_from = 0  # the first frame of the user's audio not yet committed
        self.calls: dict[str, str] = {}  # GA call_id -> the runtime's call_id
        # A server-run call's runtime call_id -> its response id, output index and item.
        self.mcp_calls: dict[str, tuple[str, int, dict[str, Any]]] = {}
        self.failure: str | None = None  # the message of a response ending as failed
        # The frames now translated are the server's silence (an owed response's
        # continuation), not client audio: they open no new response.
        self.server_frames = False
        self.muted_since: int | None = None  # a cancelled utterance's last text frame
        self.frame = 0  # the latest frame seen
        self.ended = False  # the stream ended (Done / Cancelled)
        self.waiting: list[Any] = []  # a response.create's metadata, while one is active
        self.session_pace = FramePace()  # the session's (its own object, summed by it)

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

    def add_item(self, item: dict[str, Any], out: Out, kind: str,
                  client: bool = False, data: bytes | None = None) -> None:
        # First: a client's item past the budget is refused.
        self.items.put(item, client, data)
        out.append({"type": kind, "previous_item_id": self.last_item_id, "item": item})
        if kind == "conversation.item.added":
            self.last_item_id = item["id"]

    # --- responses -------------------------------------------------------

    def start_response(self, out: Out | None, frame: int,
               metadata: Any = None) -> None:
        """A new response from ``frame``; announced now unless ``out`` is ``None``."""
        bound = self._frames(self.config.max_response_seconds)
        response = Response(new_id("resp"), frame, frame, frame + bound - 1,
                             metadata=metadata)
        response.audio = OutputAudio(self.config.output_format, self.model_rate)
        self.response = response
        if out is not None:
            self.announce(out)

    def announce(self, out: Out) -> None:
        response = self.response
        if not response.announced:
            response.announced = True
            out.append({"type": "response.created",
                        "response": self._response_object(response)})

    def _start_message(self, out: Out) -> None:
        response = self.response
        message = Message(new_id("item"), len(response.output))
        response.message = message
        item = ga_items.assistant_message(message.id)
        out.append({"type": "response.output_item.added", "response_id": response.id,
                    "output_index": message.output_index, "item": item})
        self.add_item(item, out, "conversation.item.added")
        out.append({"type": "response.content_part.added", **self._part(response),
                    "part": ga_items.content_part(self._audio_out, "")})

    def _audio_delta(self, response: Response, data: bytes) -> AudioOut:
        """``response.output_audio.delta`` with ``data`` (the client's format) apart."""
        fmt = response.audio.format
        return AudioOut({"type": "response.output_audio.delta", **self._part(response),
                         "delta": None}, "delta", data, fmt.type, fmt.rate)

    def _part(self, response: Response) -> dict[str, Any]:
        return {"response_id": response.id, "item_id": response.message.id,
                "output_index": response.message.output_index, "content_index": 0}

    def close_message(self, out: Out, status: str = "completed") -> None:
        response = self.response
        message = response.message if response is not None else None
        if message is None:
            return
        where = self._part(response)
        if self._audio_out:
            tail = response.audio.encoded(np.zeros(0, np.float32), last=True)  # its resampler's
            if tail:
                out.append(self._audio_delta(response, tail))
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
        self.add_item(item, out, "conversation.item.done")
        out.append({"type": "response.output_item.done", "response_id": response.id,
                    "output_index": message.output_index, "item": item})
        response.output.insert(message.output_index, item)
        response.message = None

    def _finish(self, out: Out, status: str) -> None:
        self.announce(out)
        self.close_message(out, status)
        response = self.response
        self.response = None
        body = self._response_object(response, status)
        out.append({"type": "response.done", "response": body,
                    "voicechat": {**response.pace.wire(), "session": self.session_pace.wire()}})
        if self.waiting:  # the request that waited opens its response
            self.start_response(out, self.frame + 1, metadata=self.waiting.pop())
            if self.ended:  # the stream is over: that response ends at once
                self._finish(out, "cancelled")

    def _response_object(self, response: Response, status: str = "in_progress") -> dict:
        usage = None
        if status != "in_progress":
            heard = max(self.frame - response.first_frame + 1, 0)
            usage = ga_items.usage(heard, response.text_tokens, response.audio_frames)
        return ga_items.response_object(response.id, self.config, response.output,
                                        response.metadata, status, usage, self.failure)

    # --- the user item -------------------------------------------------------

    def _close_user(self, out: Out, stopped: bool) -> str:
        """End the user's item (``committed`` and the item); its id, or a new one if none."""
        user = self.user
        self.user = None
        # The audio this commit transcribed: every frame heard since the previous one.
        heard = max(self.frame + 1 - self.user_from, 0)
        self.user_from = self.frame + 1
        if user is None:
            return new_id("item")
        if stopped and self.config.turn_detection is not None:
            out.append({"type": "input_audio_buffer.speech_stopped",
                        "audio_end_ms": self._ms(user.last_frame + 1), "item_id": user.id})
        out.append({"type": "input_audio_buffer.committed",
                    "previous_item_id": self.last_item_id, "item_id": user.id})
        item = ga_items.user_message(user.id, user.text)
        self.add_item(item, out, "conversation.item.added")
        self.add_item(item, out, "conversation.item.done")
        out.append({"type": "conversation.item.input_audio_transcription.completed",
                    "item_id": user.id, "content_index": 0, "transcript": user.text,
                    "usage": {"type": "duration",
                              "seconds": round(heard * self.frame_seconds, 3)}})
        return user.id

    # --- one frame's events ---------------------------------------------------

    def translate(self, events: list[Event]) -> list[Outgoing]:
        out: Out = []
        for event in events:
            self._event(event, out)
        return outgoing(out)

    def _event(self, event: Event, out: Out) -> None:
        self.frame = max(self.frame, int(event.frame_index))
        if isinstance(event, Audio):
            self._audio(event, out)
        elif isinstance(event, AssistantTextDelta):
            self._text(event, out)
        elif isinstance(event, UserTranscriptDelta):
            self._user(event, out)
        elif isinstance(event, ServerToolCall):  # the server runs it: an mcp_call item
            mcp_calls.mcp_call(self, event, out)
        elif isinstance(event, ToolOutput):
            mcp_calls.mcp_output(self, event, out)
        elif isinstance(event, ApprovalRequest):
            mcp_tools.approval_request(self, event, out)
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

    def _audio(self, event: Audio, out: Out) -> None:
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
            data = response.audio.encoded(event.samples)
            if data:
                out.append(self._audio_delta(response, data))
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

    def _text(self, event: AssistantTextDelta, out: Out) -> None:
        frame = int(event.frame_index)
        if self.muted_since is not None:
            self.muted_since = frame
            return
        if self.response is None:
            if self.server_frames:
                return  # the server's silence was for an answer that has ended
            self.start_response(out, frame)
        response = self.response
        self.announce(out)
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

    def _tool_call(self, event: ToolCall, out: Out) -> None:
        if self.response is None:
            self.start_response(out, int(event.frame_index))
        response = self.response
        self.announce(out)
        self.close_message(out)
        item_id = new_id("item")
        index = len(response.output)
        call_id = "call_" + event.call_id.removeprefix("call_")[: MAX_CALL_ID_CHARS - 5]
        self.calls[call_id] = event.call_id
        item = ga_items.function_call(item_id, call_id, event.name)
        where = {"response_id": response.id, "item_id": item_id, "output_index": index,
                 "call_id": call_id}
        out.append({"type": "response.output_item.added", "response_id": response.id,
                    "output_index": index, "item": item})
        self.add_item(item, out, "conversation.item.added")
        out.append({"type": "response.function_call_arguments.delta", **where,
                    "delta": event.arguments})
        out.append({"type": "response.function_call_arguments.done", **where,
                    "name": event.name, "arguments": event.arguments})
        done = ga_items.function_call(item_id, call_id, event.name, event.arguments,
                                      "completed")
        self.add_item(done, out, "conversation.item.done")
        out.append({"type": "response.output_item.done", "response_id": response.id,
                    "output_index": index, "item": done})
        response.output.append(done)
        self._finish(out, "completed")  # the client runs the tool now

    def _user(self, event: UserTranscriptDelta, out: Out) -> None:
        frame = int(event.frame_index)
        if self.user is None:
            self.user = UserItem(new_id("item"), frame, frame)
            if self.config.turn_detection is not None:
                out.append({"type": "input_audio_buffer.speech_started",
                            "audio_start_ms": self._ms(frame), "item_id": self.user.id})
        self.user.last_frame = frame
        self.user.text += event.delta  # event.text is the whole session's transcript
        out.append({"type": "conversation.item.input_audio_transcription.delta",
                    "item_id": self.user.id, "content_index": 0, "delta": event.delta})

    def paced(self, pace: FramePace) -> None:
        """The next frames' lateness counts for the open response."""
        if self.response is not None:
            self.response.pace.add(pace)

    # --- client requests ---------------------------------------------------------

    @property
    def owes(self) -> bool:
        """A response is open or owed: the timeline must run until it ends."""
        return self.response is not None

    def commit(self) -> Out:
        """``input_audio_buffer.commit``: the user item so far is committed; with
        turn detection off a response is owed (announced when the model speaks)."""
        out: Out = []
        if self.user is None:
            item_id = new_id("item")
            self.user_from = self.frame + 1  # nothing was said: no transcription
            out.append({"type": "input_audio_buffer.committed",
                        "previous_item_id": self.last_item_id, "item_id": item_id})
        else:
            self._close_user(out, stopped=False)
        if self.config.turn_detection is None and self.response is None \
                and self._audio_out and not self.ended:
            self.start_response(None, self.frame + 1)
        return out

    def cancel(self) -> Out | None:
        """``response.cancel``: the response's events, or ``None`` when none is active.
        The rest of the utterance (until its EOS or a pause) is not sent."""
        if self.response is None:
            return None
        out: Out = []
        self.muted_since = max(self.response.last_text_frame, self.frame)
        self._finish(out, "cancelled")
        return out

    def truncate(self, item_id: str) -> Out | None:
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

    def fail(self, message: str) -> Out:
        """The timeline could not run: the owed response ends as ``failed``."""
        out: Out = []
        if self.response is not None:
            self.failure = message
            self._finish(out, "failed")
            self.failure = None
        return out

    def restart(self) -> Out:
        """A new engine timeline: the open response and user item end, frames count anew."""
        out: Out = []
        if self.response is not None:
            self._finish(out, "cancelled")
        self._close_user(out, stopped=False)
        self.frame, self.user_from, self.muted_since, self.ended = 0, 0, None, False
        return out

    def runtime_call_id(self, call_id: str) -> str:
        """The runtime's id of a call announced as ``call_id`` (unknown ids pass through)."""
        return self.calls.get(call_id, call_id)

    def request(self, response: Any) -> Out | None:
        """``response.create``: ``response.created`` now (the model's next utterance fills
        it), or for an owed, unannounced one; while one is active, nothing yet (its
        response opens when the active one is done); ``None`` when a request already
        waits or the stream has ended."""
        metadata = response.get("metadata") if isinstance(response, dict) else None
        out: Out = []
        if self.response is None:
            if self.ended:
                return None
            self.start_response(None, self.frame + 1)
        elif self.response.announced:
            if self.waiting or self.ended:
                return None
            self.waiting.append(metadata)
            return out
        self.response.metadata = metadata
        self.announce(out)
        return out

    def delete(self, item_id: Any) -> dict[str, Any]:
        """``conversation.item.delete``: acknowledged; the item is no longer retrieved."""
        if not isinstance(item_id, str):
            raise invalid("item_id must be a string")
        self.items.pop(item_id)
        return {"type": "conversation.item.deleted", "item_id": item_id}

    def retrieve(self, item_id: Any) -> dict[str, Any]:
        """``conversation.item.retrieve``: ``conversation.item.retrieved`` with the item as
        last sent; an unknown id is OpenAI's ``item_retrieve_invalid_item_id``."""
        if not isinstance(item_id, str):
            raise invalid("item_id must be a string")
        item = self.items.get(item_id)
        if item is None:
            raise ProtocolError("item_retrieve_invalid_item_id",
                                f"Error retrieving item: the item with id {item_id[:64]!r} "
                                "does not exist.")
        return {"type": "conversation.item.retrieved", "item": item}

    @property
    def active_response_id(self) -> str | None:
        return None if self.response is None else self.response.id

    def item_added(self, item: dict[str, Any], data: bytes | None = None) -> Out:
        """A client-created item (a tool result): ``conversation.item.added`` / ``done``
        (``invalid_request``, nothing changed, past ``max_item_bytes``); ``data``: the
        item's JSON, when already made."""
        out: Out = []
        data = self.items.encode(item) if data is None else data
        self.add_item(item, out, "conversation.item.added", client=True, data=data)
        self.add_item(item, out, "conversation.item.done", client=True, data=data)
        return out

