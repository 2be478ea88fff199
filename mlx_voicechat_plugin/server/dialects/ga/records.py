"""What one GA session's responses keep: the conversation items as sent, the open
response with its message, and the user's item (:class:`~.responses.GAResponses`
opens and closes them; the wire shapes are :mod:`.items`'). Only the session's
event loop touches them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ...engine.pace import FramePace
from ...messages import AudioOut
from ...limits import ServerLimits
from ...wire import invalid
from .audio import OutputAudio

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
