"""What one conversation is started with, offline or streaming: validated once, here.

The rules live in small ``check_*`` functions so that the server's protocol
layer applies the same ones to ``session.update`` fields (with its own field
names in the messages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..quoting import brief
from .rng import check_seed
from .tool_calls import DEFAULT_MAX_CALLS_PER_TURN
from .tools import DEFAULT_MAX_TOOLS

# An offline turn takes at most this much input, and this much silence after it.
MAX_INPUT_SECONDS = 20 * 60.0
MAX_EXTRA_DECODING_SECONDS = 600.0
DEFAULT_EXTRA_DECODING_SECONDS = 3.0  # decoded after the question when none is given


def _real(value: object) -> bool:
    """A finite int or float, not a bool."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def check_positive_seconds(value: object, what: str) -> float:
    """A finite number of seconds above zero."""
    if not _real(value) or value <= 0:
        raise ValueError(f"{what} must be > 0, got {brief(value)}")
    return float(value)


# The model card: trained on audio contexts of at most 2 minutes.
DEFAULT_CONTEXT_SECONDS = 120.0


def check_context_seconds(value: object) -> float | None:
    """``None`` or ``0``: unbounded; else a finite number of seconds above zero."""
    if value is None:
        return None
    return check_non_negative(value, "context_seconds (0: unbounded)") or None


def check_positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {brief(value)}")
    return value


def check_count(value: object, what: str) -> int:
    """An integer >= 0 (0: off)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {brief(value)}")
    return value


def check_non_negative(value: object, what: str) -> float:
    """A finite number >= 0."""
    if not _real(value) or value < 0:
        raise ValueError(f"{what} must be >= 0, got {brief(value)}")
    return float(value)


def buffered_samples(seconds: float, sample_rate: int, frame_samples: int) -> int:
    """A bound on buffered input given in seconds, in samples: never less than a frame
    (a stream must be able to hold the frame it is completing). The server's
    ``--max-buffered-seconds`` is this bound on its session channels."""
    return max(int(seconds * sample_rate), frame_samples)


def check_temperature(value: object, what: str = "temperature") -> float:
    """The text channel's temperature: only 0 (the reference's VoiceChat path decodes
    its text greedily; nothing samples it)."""
    if not _real(value) or value != 0:
        raise ValueError(
            f"{what} must be 0 (the model's text channel is decoded greedily, as the "
            f"reference's), got {brief(value)}"
        )
    return 0.0


def check_top_p(value: object, what: str = "top_p") -> float | None:
    """The speech head's nucleus: ``None`` (the checkpoint's ``tts_config.top_p``) or a
    number in (0, 1]."""
    if value is None:
        return None
    if not _real(value) or not 0 < value <= 1:
        raise ValueError(f"{what} must be in (0, 1], got {brief(value)}")
    return float(value)


@dataclass(kw_only=True)
class StreamLimits:
    """What the streaming shell (:class:`~.streaming.StreamingShell`) enforces, for
    either core; keyword-only, after each options class's own fields."""

    use_perception_cache: bool = True
    max_streaming_seconds: float | None = None
    # Samples one push may leave waiting for a frame, with what is already buffered
    # (the stream's own framer; a server bounds its channels with buffered_samples).
    max_buffered_samples: int | None = None
    # UTF-8 bytes of the user transcript; a frame does not start once it is reached.
    max_transcript_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_streaming_seconds is not None:
            self.max_streaming_seconds = check_positive_seconds(
                self.max_streaming_seconds, "max_streaming_seconds"
            )
        for name in ("max_buffered_samples", "max_transcript_bytes"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)

    def max_frames(self, frame_duration: float) -> int | None:
        """The frames a stream runs at most (``None``: no limit), the one count the shell
        stops at and a session's reservation assumes."""
        seconds = self.max_streaming_seconds
        return None if seconds is None else int(seconds / frame_duration)


@dataclass
class ConversationOptions(StreamLimits):
    """Options of one conversation (``VoiceChat.generate`` and streaming sessions).

    The :class:`StreamLimits` fields only concern the streaming front end;
    offline turns run the whole-signal perception.
    """

    system_prompt: str | None = None
    seed: int = 0
    tools: list[dict] | None = None
    max_tools: int = DEFAULT_MAX_TOOLS
    max_tool_calls_per_turn: int = DEFAULT_MAX_CALLS_PER_TURN
    # System prompt + rendered tools, in tokens; checked before any work.
    max_prompt_tokens: int | None = None
    use_language_cache: bool = True
    # Seconds of conversation the attention layers keep after the prompt (a ring;
    # docs/long-conversations.md); 0 or None: unbounded, every position (the reference).
    context_seconds: float | None = DEFAULT_CONTEXT_SECONDS
    profile: bool = False
    # Emit ``TurnEnded`` at the text channel's EOS (the GA dialect's responses).
    turn_events: bool = False
    # mlx-lm's sampling names. The text channel is greedy (the reference's): 0 only.
    temperature: float = 0.0
    # The speech head's nucleus; None: the checkpoint's tts_config.top_p.
    top_p: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise TypeError(f"system_prompt must be a string, got {type(self.system_prompt).__name__}")
        check_seed(self.seed)
        check_positive_int(self.max_tools, "max_tools")
        check_positive_int(self.max_tool_calls_per_turn, "max_tool_calls_per_turn")
        if self.max_prompt_tokens is not None:
            check_positive_int(self.max_prompt_tokens, "max_prompt_tokens")
        self.context_seconds = check_context_seconds(self.context_seconds)
        self.temperature = check_temperature(self.temperature)
        self.top_p = check_top_p(self.top_p)


@dataclass
class TranscriptionOptions(StreamLimits):
    """Options of a transcript-only stream (perception and the RNNT): the stream limits."""


def check_extra_decoding_seconds(value: float) -> float:
    if not _real(value) or not 0 <= value <= MAX_EXTRA_DECODING_SECONDS:
        raise ValueError(
            "extra_decoding_seconds must be within "
            f"[0, {MAX_EXTRA_DECODING_SECONDS:g}] s, got {brief(value)}"
        )
    return float(value)
