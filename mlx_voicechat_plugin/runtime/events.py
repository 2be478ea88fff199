"""Events a streaming session emits, one frame at a time.

Text deltas skip pad, silence, BOS and EOS. ``delta`` is the new suffix when
the cumulative decode extends the previous one, else the single-token decode;
``text`` (the cumulative decode) is authoritative.

The audio rule: exactly one :class:`Audio` per frame, ``frame_index`` 0, 1,
2, ... with no gaps, each carrying that frame's codes and exactly
``samples_per_frame`` (1764) samples; joined, they equal the offline decode
of the same codes sample for sample, with no lead-in. The codec's iSTFT
makes the last ``stream_lag`` (6) samples of a frame depend on the next
frame's spectrum, so a frame's ``Audio`` is released when the next frame has
been decoded (it comes first among that frame's events), or by ``flush`` /
``cancel``, which close the stream and complete the last frame with the held
tail. The total order of events therefore equals the reference's
(transcript, text, function, audio per frame); the audio of a frame leaves one
frame later than its text.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Union

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
    """One frame's final output samples and its 31 codes (see the module's audio rule)."""

    frame_index: int
    samples: np.ndarray  # float32, samples_per_frame of them
    sample_rate: int
    audio_codes: np.ndarray  # (Q,) int32


class AudioFrames:
    """Turns codec outputs into one complete :class:`Audio` per frame.

    ``push`` takes a frame's codes and the samples the codec released for it
    (``samples_per_frame - lag`` for the first frame, then ``samples_per_frame``:
    the previous frame's held tail and this frame's head). It returns the
    previous frame's ``Audio``, now complete, and holds this frame's.
    ``finish`` takes the codec's flushed tail and returns the last frame's.
    """

    def __init__(self, samples_per_frame: int, sample_rate: int):
        self.samples_per_frame = samples_per_frame
        self.sample_rate = sample_rate
        self._held: tuple[int, np.ndarray, np.ndarray] | None = None

    def push(self, frame_index: int, codes: np.ndarray, samples: np.ndarray) -> Audio | None:
        done = None
        if self._held is not None:
            need = self.samples_per_frame - self._held[2].shape[0]
            done = self._complete(samples[:need])
            samples = samples[need:]
        self._held = (frame_index, codes, samples)
        return done

    def finish(self, tail: np.ndarray) -> Audio | None:
        """Complete the held frame with the stream's last samples (``None`` if none held)."""
        return None if self._held is None else self._complete(tail)

    def _complete(self, rest: np.ndarray) -> Audio:
        """The held frame completed with ``rest``; none is held after it."""
        index, codes, head = self._held
        self._held = None
        samples = np.concatenate([head, rest])
        if samples.shape[0] != self.samples_per_frame:
            raise RuntimeError(
                f"frame {index} has {samples.shape[0]} samples, expected {self.samples_per_frame}"
            )
        return Audio(index, samples, self.sample_rate, codes)


@dataclass(frozen=True)
class Done:
    frame_index: int


@dataclass(frozen=True)
class Cancelled:
    frame_index: int


@dataclass(frozen=True)
class TranscriptDone:
    """The final user transcript of a text-only stream (exactly one, at ``flush``)."""

    frame_index: int
    text: str


@dataclass(frozen=True)
class TurnEnded:
    """The text channel's end-of-turn token (EOS): the model ended its utterance.

    Only for sessions opened with ``ConversationOptions.turn_events``; the mlx-vlm
    events have no counterpart (the reference does not emit one).
    """

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
    TranscriptDone,
    TurnEnded,
]


def ids_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=False)`` of a list of Python ints.

    A transformers tokenizer whose ``decode`` is the base class's first converts
    its input to Python objects (``to_py_obj``: a type check per id, most of a
    short decode's host time), then calls ``_decode``; a list of Python ints is
    such an object already, so its decode is that ``_decode`` call, made
    directly. Any other tokenizer (one that overrides ``decode``, or not a
    transformers one) is called as it is.
    """
    base = sys.modules.get("transformers.tokenization_utils_base")
    if (base is not None and type(tokenizer).decode is base.PreTrainedTokenizerBase.decode
            and callable(getattr(tokenizer, "_decode", None))):
        return lambda ids: tokenizer._decode(ids, skip_special_tokens=False)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


class TokenText:
    """Cumulative detokenization of one channel's visible tokens, in time linear in its length
    (and, with ``keep_chars``, in memory bounded: ``text`` is then the channel's last
    ``keep_chars`` to ``2 * keep_chars`` characters).

    ``text`` is the decode of every visible token so far, as one
    ``tokenizer.decode`` call would give it; each visible token's ``delta`` is
    the new suffix of ``text`` when it extends the previous one, else the
    token's own decode (the reference's rule).

    Re-decoding the whole channel per token is quadratic over a long session,
    so tokens are decoded in a window (mlx-lm's streaming detokenizers, the
    prefix/read offsets of vLLM and TGI): the tokens up to ``_read`` are
    settled, their text is ``_settled``; a new token decodes
    ``tokens[_prefix:]``, where ``tokens[_prefix:_read]`` is left context that
    lets the tokenizer join spaces and multi-byte characters across the
    boundary exactly as a full decode does. The window's context must decode
    to a prefix of the window's text, else (a tokenizer whose decode is not
    local) the channel is decoded whole for that token. The settled point
    only advances where the text does not end inside a character.
    """

    CONTEXT_TOKENS = 8

    def __init__(self, tokenizer: Any, hidden_ids: frozenset[int],
                 keep_chars: int | None = None):
        self.tokenizer = tokenizer
        self._decode = ids_decoder(tokenizer)
        self.hidden_ids = hidden_ids
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0
        self._settled = ""
        self._context = ""  # decode(tokens[_prefix:_read])
        # Bounded (a conversation of any length): once ``text`` passes twice
        # ``keep_chars`` it keeps its last ``keep_chars`` characters (``dropped``
        # counts the ones cut off its front), and settled tokens before the
        # decode window are forgotten (``_head``: the text they decoded to).
        self.keep_chars = keep_chars
        self.dropped = 0
        self._head = ""

    def append(self, token_id: int) -> tuple[str, str] | None:
        """Add a token; ``(delta, text)`` if it is visible, else ``None``."""
        if token_id in self.hidden_ids:
            return None
        self.tokens.append(token_id)
        window = self._decode(self.tokens[self._prefix :])
        local = window.startswith(self._context)
        if local:
            text = self._settled + window[len(self._context) :]
        else:
            text = self._head + self._decode(self.tokens)
        if text.startswith(self.text):
            delta = text[len(self.text) :]
        else:
            delta = self._decode([token_id])
        self.text = text
        if not text.endswith("\ufffd"):
            self._settle(window if local else None)  # not local: the next window starts afresh
        return delta, self.text

    def _settle(self, window: str | None) -> None:
        """Settle every token so far. The window's start stays put until its context
        passes ``2 * CONTEXT_TOKENS`` tokens (then it moves to the last
        ``CONTEXT_TOKENS``), so the next context is most often the window just
        decoded (``window``): one decode a token, not two."""
        self._read = len(self.tokens)
        self._settled = self.text
        if window is not None and self._read - self._prefix <= 2 * self.CONTEXT_TOKENS:
            self._context = window
        else:
            self._prefix = max(0, self._read - self.CONTEXT_TOKENS)
            self._context = self._decode(self.tokens[self._prefix : self._read])
        if self.keep_chars is not None and len(self.text) > 2 * self.keep_chars:
            self._bound(self.keep_chars)

    def _bound(self, keep: int) -> None:
        """Forget the settled tokens before the window and all but ``keep`` characters."""
        if not self._settled.endswith(self._context):
            return  # the window's text is not a suffix here: bound at a later token
        self._head = self._settled[: len(self._settled) - len(self._context)]
        del self.tokens[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        cut = min(len(self.text) - keep, len(self._head))
        self.text, self._settled = self.text[cut:], self._settled[cut:]
        self._head = self._head[cut:]
        self.dropped += cut
