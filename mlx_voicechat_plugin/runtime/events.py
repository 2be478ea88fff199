"""Events a streaming session emits, one frame at a time.

Text deltas skip pad, silence, BOS and EOS. ``delta`` is the new suffix when
the cumulative decode extends the previous one, else the single-token decode;
``text`` (the cumulative decode) is authoritative.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np


@dataclass(frozen=True)
class AssistantTextDelta:
    frame_index: int
    token_id: int
    delta: str
    text: str


@dataclass(frozen=True)
class FunctionDelta:
    frame_index: int
    token_id: int
    delta: str
    text: str


@dataclass(frozen=True)
class UserTranscriptDelta:
    frame_index: int
    delta: str
    text: str


@dataclass(frozen=True)
class Audio:
    """Newly final output samples and the frame's 31 codes.

    A frame carries ``samples_per_frame`` (1764) samples, except that the
    codec's iSTFT holds its last ``stream_lag`` (6) samples until the next frame
    exists: the first frame carries 1758 and ``flush`` emits a last ``Audio``
    with the held tail. Joined, the samples equal the offline decode exactly.
    """

    frame_index: int
    samples: np.ndarray  # float32
    sample_rate: int
    audio_codes: np.ndarray  # (Q,) int32; empty for the flushed tail


@dataclass(frozen=True)
class Done:
    frame_index: int


@dataclass(frozen=True)
class Cancelled:
    frame_index: int


@dataclass(frozen=True)
class ToolCall:
    """A complete, schema-valid call parsed from the function channel."""

    frame_index: int
    call_id: str  # "call_" + hex
    name: str
    arguments: str  # a JSON object


@dataclass(frozen=True)
class ToolCallInvalid:
    """Function-channel text that did not make a valid call; never sent as a call.

    ``reason`` is one of ``malformed``, ``unknown_tool``, ``schema``,
    ``limit`` (too many calls this user turn) or ``unterminated``.
    """

    frame_index: int
    reason: str
    message: str
    raw: str
    code: str = "tool_call_invalid"


@dataclass(frozen=True)
class ToolResultInjected:
    """A tool result's last token entered the timeline at ``frame_index``."""

    frame_index: int
    call_id: str
    first_frame: int
    num_tokens: int


@dataclass(frozen=True)
class ToolsWarning:
    frame_index: int
    message: str


Event = Union[
    AssistantTextDelta,
    FunctionDelta,
    UserTranscriptDelta,
    Audio,
    Done,
    Cancelled,
    ToolCall,
    ToolCallInvalid,
    ToolResultInjected,
    ToolsWarning,
]


class TokenText:
    """Cumulative detokenization of one channel's visible tokens."""

    def __init__(self, tokenizer: Any, hidden_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.hidden_ids = hidden_ids
        self.tokens: list[int] = []
        self.text = ""

    def append(self, token_id: int) -> tuple[str, str] | None:
        """Add a token; ``(delta, text)`` if it is visible, else ``None``."""
        if token_id in self.hidden_ids:
            return None
        self.tokens.append(token_id)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=False)
        if text.startswith(self.text):
            delta = text[len(self.text) :]
        else:
            delta = self.tokenizer.decode([token_id], skip_special_tokens=False)
        self.text = text
        return delta, text
