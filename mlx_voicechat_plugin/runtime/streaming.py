"""Online voice chat: PCM chunks in, aligned text / transcript / audio events out.

Every network advances exactly one frame per 1280-sample frame from persistent
state (see :class:`PerceptionStream`, :class:`Timeline`, the RNNT state and the
codec stream). The recurrence itself is :class:`Timeline`, the same object
offline generation drives. A session is driven from one thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
import numpy as np

from ..models.perception_stream import PerceptionStream
from .audio import as_mono_float32
from .events import (
    AssistantTextDelta,
    AudioFrames,
    Cancelled,
    Done,
    Event,
    FunctionDelta,
    TokenText,
    ToolsWarning,
    UserTranscriptDelta,
)
from .profile import FrameClock, Profile, profile_env
from .prompt_cache import PromptCache
from .rng import check_seed
from .timeline import Timeline, replace_control_codes
from .tool_calls import DEFAULT_MAX_CALLS_PER_TURN, ToolChannel, tool_prompt
from .tools import DEFAULT_MAX_TOOLS, ToolError

if TYPE_CHECKING:
    from .session import VoiceChatSession


class ContextLimit(RuntimeError):
    """The stream reached ``max_streaming_seconds``.

    ``events``: those of the frames the same ``push_audio`` call ran before the
    limit (nothing is lost); the session stays open for ``flush``/``cancel``.
    """

    def __init__(self, message: str, events: list | None = None):
        super().__init__(message)
        self.events: list = [] if events is None else events


class SessionClosed(RuntimeError):
    """The session has ended (flushed, cancelled or failed)."""


@dataclass
class StreamingOptions:
    system_prompt: str | None = None
    seed: int = 0
    max_streaming_seconds: float | None = None
    use_language_cache: bool = True
    use_perception_cache: bool = True
    profile: bool = False
    tools: list[dict] | None = None
    max_tools: int = DEFAULT_MAX_TOOLS
    max_tool_calls_per_turn: int = DEFAULT_MAX_CALLS_PER_TURN
    # System prompt + rendered tools, in tokens; checked before any work.
    max_prompt_tokens: int | None = None
    # Asked before each prefill position; True stops it (PrefillCancelled).
    stop_prefill: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        limit = self.max_streaming_seconds
        if limit is not None and (isinstance(limit, bool) or not limit > 0):
            raise ValueError(f"max_streaming_seconds must be > 0, got {limit!r}")
        check_seed(self.seed)
        for name in ("max_tools", "max_tool_calls_per_turn", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_prompt_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _as_chunk(samples: Any) -> np.ndarray:
    """Validate one PCM chunk: mono float samples, finite."""
    if isinstance(samples, mx.array):
        samples = np.array(samples)
    if not isinstance(samples, np.ndarray):
        raise TypeError(f"audio chunk must be a numpy or mlx array, got {type(samples).__name__}")
    if not np.issubdtype(samples.dtype, np.floating):
        raise TypeError(f"audio chunk must hold float samples in [-1, 1], got dtype {samples.dtype}")
    return as_mono_float32(samples, "audio chunk")


def prompt_cache_of(model: Any) -> PromptCache:
    """The model's prompt cache (``model.prompt_cache``; made with the default budget)."""
    cache = getattr(model, "prompt_cache", None)
    if cache is None:
        cache = PromptCache()
        model.prompt_cache = cache  # a plain attribute: not part of the module tree
    return cache


class StreamingSession:
    def __init__(self, parent: "VoiceChatSession", options: StreamingOptions):
        model = parent.model
        config = model.config
        self.parent = parent
        self.model = model
        self.config = config
        self.options = options
        self.frame_samples = config.frame_samples
        self.sample_rate = config.input_sample_rate
        self.max_frames = (
            None
            if options.max_streaming_seconds is None
            else int(options.max_streaming_seconds / config.frame_duration)
        )
        sub_stages, self._frames_path = profile_env()
        self._clock = FrameClock(options.profile, sub_stages)
        self._profile = Profile(frame_duration_ms=config.frame_duration * 1000.0)

        self.timeline = Timeline(
            model, seed=options.seed, use_language_cache=options.use_language_cache
        )
        self._perception = PerceptionStream(
            model.stt_model.perception, config, options.use_perception_cache
        )
        self._rnnt = parent.new_rnnt_state()
        hidden = config.special_text_ids
        self._text = TokenText(parent.tokenizer, hidden)
        self._function = TokenText(parent.tokenizer, hidden)
        self._codec = model.tts_model.audio_codec
        self._codec_state = self._codec.make_state()
        self._audio = AudioFrames(self._codec.samples_per_frame, config.output_sample_rate)
        self._pending = np.zeros((0,), dtype=np.float32)
        self.frame_index = 0
        self.closed = False
        prompt, toolset = tool_prompt(
            parent.tokenizer, model, options.system_prompt, options.tools, options.max_tools
        )
        limit = options.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise ValueError(
                f"the system prompt and tools are {len(prompt)} tokens; at most "
                f"max_prompt_tokens={limit} are allowed"
            )
        self.tools: ToolChannel | None = None
        self._notices: list[Event] = []
        if toolset is not None:
            self.tools = ToolChannel(
                toolset, parent.tokenizer, max_calls_per_turn=options.max_tool_calls_per_turn
            )
            self._notices = [ToolsWarning(0, message) for message in toolset.warnings]
        # The system prompt advances the timeline but emits nothing.
        self.prompt_cache_hit = self._start_timeline(prompt)

    def _start_timeline(self, prompt: list[int]) -> bool:
        """Prefill the prompt, or continue from the model's cached state for it."""
        cache = prompt_cache_of(self.model)
        if not prompt or not self.options.use_language_cache or not cache.max_bytes:
            self.timeline.prefill(prompt, self.options.stop_prefill)
            return False
        key = (tuple(prompt), self.options.seed)
        state = cache.get(key)
        if state is not None:
            self.timeline.restore(state)
            return True
        self.timeline.prefill(prompt, self.options.stop_prefill)
        cache.put(key, self.timeline.snapshot())
        return False

    # --- the frame ------------------------------------------------------

    def _frame(self, frame: np.ndarray) -> list[Event]:
        try:
            return self._frame_events(frame)
        except BaseException:
            self._clock.abandon()  # stop counting syncs for a frame that failed
            raise

    def _frame_events(self, frame: np.ndarray) -> list[Event]:
        """One frame in two evaluations: the listening half, then the speaking half.

        The first evaluates the encoder step and the token ids (the TTS spells
        the text token on the host); the second the RNNT frame, the TTS codes
        and the codec samples. Work is started as soon as its graph is built
        (``async_eval``, not a sync: nothing waits), so MLX computes one part
        while this thread builds the next and decodes the token texts.
        Profiling adds its own stage barriers, not counted as host syncs.
        """
        if self._at_limit():
            raise ContextLimit(
                f"stream reached max_streaming_seconds={self.options.max_streaming_seconds:g} "
                f"({self.max_frames} frames)"
            )
        clock, index = self._clock, self.frame_index
        clock.start(index)
        projected, encoded = self._perception.push(frame, clock)
        clock.stage("perception", projected, encoded, *self._perception.arrays())
        mx.async_eval(projected, encoded, *self._perception.arrays())
        # The RNNT's first try joins the first evaluation; a blank (most
        # frames of real speech) ends the frame's transcript work there.
        first = self._rnnt.advance_first(encoded)
        listening = [] if first is None else [first, *self._rnnt.arrays()]
        forced = None if self.tools is None else self.tools.next_forced()
        tokens = self.timeline.listen(projected, force_function=forced, clock=clock)
        mx.eval(tokens.ids, *self._perception.arrays(), *listening)

        # The user transcript does not feed the timeline: the RNNT's other
        # tries (after an emission) compute while the speech half is built.
        symbols = self._rnnt.advance_rest(first)
        speaking = [] if symbols is None or symbols is first else [symbols, *self._rnnt.arrays()]
        if speaking:
            mx.async_eval(*speaking)
        clock.stage("rnnt", *speaking)
        step = self.timeline.speak(tokens, clock)
        clock.stage("tts", step.codes)
        codes = replace_control_codes(self.model, step.codes)
        samples = self._codec.decode_step(
            codes.transpose(0, 2, 1), self._codec_state, evaluate=False
        )
        frame_samples, frame_codes = samples[0, 0], codes[0, 0].astype(mx.int32)
        speaking += [step.codes, frame_samples, frame_codes, *self._codec_state.arrays()]
        mx.async_eval(*speaking)
        text_update = self._text.append(step.text_id)
        function_update = None if step.function_forced else self._function.append(step.function_id)
        mx.eval(*speaking)
        clock.sub_stage("codec.decoder_istft")
        clock.stage("codec")

        events: list[Event] = self._notices
        self._notices = []
        finished = self._audio.push(index, np.array(frame_codes), np.array(frame_samples))
        if finished is not None:
            events.append(finished)
        delta = self._rnnt.commit(symbols)
        if delta is not None:
            events.append(UserTranscriptDelta(index, delta, self._rnnt.text))
            if self.tools is not None:
                self.tools.parser.new_turn()
        if text_update is not None:
            events.append(AssistantTextDelta(index, step.text_id, *text_update))
        if step.function_forced:
            events.extend(self.tools.forced(index))
        elif function_update is not None:
            events.append(FunctionDelta(index, step.function_id, *function_update))
            if self.tools is not None:
                events.extend(self.tools.observe(self._function.text, index))
        timing = clock.finish()
        if timing is not None:
            self._profile.frames.append(timing)
        self.frame_index += 1
        return events

    # --- the API --------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosed("streaming session is closed")

    def push_audio(self, samples: Any, sample_rate: int | None = None) -> list[Event]:
        """Consume a mono float PCM chunk of any size; return the completed frames' events.

        Bad input (rate, dtype, shape, non-finite samples) raises before anything
        is consumed, and the session stays usable.
        """
        self._check_open()
        rate = self.sample_rate if sample_rate is None else sample_rate
        if rate != self.sample_rate:
            raise ValueError(f"sample_rate must be {self.sample_rate} Hz, got {rate}")
        chunk = _as_chunk(samples)
        self._pending = np.concatenate([self._pending, chunk])
        events: list[Event] = []
        while self._pending.shape[0] >= self.frame_samples:
            frame = self._pending[: self.frame_samples]
            self._pending = self._pending[self.frame_samples :]
            try:
                events.extend(self._frame(frame))
            except ContextLimit as exc:
                self._pending = np.zeros((0,), dtype=np.float32)
                exc.events = events
                raise
        return events

    def _at_limit(self) -> bool:
        return self.max_frames is not None and self.frame_index >= self.max_frames

    def flush(self, pad_partial: bool = True) -> list[Event]:
        """End the input: optionally zero-pad and run the partial frame, then ``Done``."""
        self._check_open()
        events: list[Event] = []
        try:
            # At the length limit the partial frame is dropped: the stream
            # still ends normally (the last frame's audio, then Done).
            if self._pending.shape[0] and pad_partial and not self._at_limit():
                frame = np.zeros((self.frame_samples,), dtype=np.float32)
                frame[: self._pending.shape[0]] = self._pending
                events.extend(self._frame(frame))
            events.extend(self._finish_audio())
            if self.tools is not None:
                events.extend(self.tools.finish(self._function.text, max(self.frame_index - 1, 0)))
        finally:
            self._close()
        events.append(Done(self.frame_index))
        return events

    def cancel(self) -> list[Event]:
        """Drop pending audio and end with ``Cancelled``."""
        if self.closed:
            return []
        try:
            events = self._finish_audio()
        finally:
            self._close()
        return [*events, Cancelled(self.frame_index)]

    def _finish_audio(self) -> list[Event]:
        """The last frame's ``Audio``, completed with the codec's held tail."""
        if not self.frame_index:
            return []
        tail = self._codec.flush(self._codec_state)
        audio = self._audio.finish(np.array(tail[0, 0]))
        return [] if audio is None else [audio]

    def submit_tool_result(self, call_id: str, output: str) -> int:
        """Feed a call's result back: its tokens enter the next frames' function input.

        Returns the number of tokens queued. Raises :class:`ToolError` when no
        tools are registered, for an unknown or already answered ``call_id``,
        and for non-ASCII output.
        """
        self._check_open()
        if self.tools is None:
            raise ToolError("no tools are registered for this session (tools_not_set)")
        return self.tools.submit(call_id, output)

    def _close(self) -> None:
        self.closed = True
        self._pending = np.zeros((0,), dtype=np.float32)
        if self._frames_path and self._profile.frames:
            self._profile.write_frames(self._frames_path)

    def profile(self) -> Profile:
        return self._profile

    @property
    def transcript(self) -> str:
        return self._rnnt.text

    @property
    def text(self) -> str:
        return self._text.text

    @property
    def function_text(self) -> str:
        return self._function.text
