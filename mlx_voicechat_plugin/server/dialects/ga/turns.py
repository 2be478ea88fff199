"""One GA session's book: its open response and user item, and how each opens and closes.

What each step emits (``response.created``, the message's
``output_item.added`` / ``content_part.added``, its ``.done`` events and
``response.done`` with ``usage``; the user item's ``committed`` and its
``conversation.item.*``); when to take which step is :mod:`.responses`'
business (the mapping of runtime events and client requests). The wire shapes
are :mod:`.items`'. Only the session's event loop touches it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...engine.pace import FramePace
from ...messages import AudioOut
from ...limits import ServerLimits
from ...wire import invalid, new_id
from . import items as ga_items
from .audio import OutputAudio
from .config import GAConfig

# What a step emits: GA events (dicts) and, for audio, the event with its bytes apart.
Out = list[dict[str, Any] | AudioOut]
# Conversation items kept for ``conversation.item.retrieve`` (the oldest go first).
MAX_ITEMS = 4096


class ItemStore:
    """A GA session's conversation items as last sent, kept as their JSON bytes (never as
    parsed trees), oldest first, within ``max_bytes``.

    A client's item that would pass ``max_bytes`` is refused (``invalid_request``:
    nothing kept changes); the server's own items push the oldest out instead.
    """

    def __init__(self, max_bytes: int = ServerLimits.max_item_bytes):
        self.max_bytes = max_bytes
        self.kept: dict[str, bytes] = {}  # item id -> the item's JSON
        self.bytes = 0

    @staticmethod
    def encode(item: dict[str, Any]) -> bytes:
        return json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode()

    def put(self, item: dict[str, Any], client: bool = False,
            data: bytes | None = None) -> None:
        """Keep ``item`` (``data``: its :meth:`encode`, when already made)."""
        data = self.encode(item) if data is None else data
        held = self.bytes - len(self.kept.get(item["id"], b""))
        if client and held + len(data) > self.max_bytes:
            raise invalid(f"conversation items would hold {held + len(data)} bytes, past "
                          f"the {self.max_bytes} this server keeps a session "
                          "(--max-item-bytes); delete some (conversation.item.delete)")
        self.pop(item["id"])
        self.kept[item["id"]] = data
        self.bytes += len(data)
        while len(self.kept) > MAX_ITEMS or (self.bytes > self.max_bytes and len(self.kept) > 1):
            self.pop(next(iter(self.kept)))

    def get(self, item_id: str) -> dict[str, Any] | None:
        data = self.kept.get(item_id)
        return None if data is None else json.loads(data)

    def pop(self, item_id: str) -> None:
        data = self.kept.pop(item_id, None)
        if data is not None:
            self.bytes -= len(data)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self.kept


@dataclass
class Message:
    id: str
    output_index: int
    text: str = ""


@dataclass
class Response:
    id: str
    first_frame: int  # usage and the bound count from here
    last_text_frame: int
    last_frame: int  # the bound: the response ends (incomplete) past this frame
    metadata: Any = None
    announced: bool = False  # response.created was sent
    spoke: bool = False  # a visible text token came
    end_frame: int | None = None  # the frame of the model's end-of-turn token
    message: Message | None = None
    output: list[dict[str, Any]] = field(default_factory=list)
    text_tokens: int = 0
    audio_frames: int = 0
    audio: OutputAudio | None = None
    pace: FramePace = field(default_factory=FramePace)  # its frames' lateness


@dataclass
class UserItem:
    id: str
    first_frame: int
    last_frame: int
    text: str = ""


class ResponseBook:
    """The open response and user item of one GA session, and the events of their steps."""

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
