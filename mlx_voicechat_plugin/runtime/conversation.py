"""One conversation's books: frame outputs in, events out, the same offline and streaming.

A :class:`Conversation` owns what is per conversation but not compute: the
prompt it started from, the visible text of the text and function channels,
the tool channel (calls, per-turn budget, result injection), the warnings,
the user transcript and the per-frame audio framing. Each :meth:`frame`
advances the compute by one frame (:func:`~.compute.advance`, a function of the
model, the conversation's :class:`~.compute.ConversationState` and the frame's
input) and turns the :class:`~.compute.FrameOutput` into events.

Offline :meth:`~.voicechat.VoiceChat.generate` and
:class:`~.streaming.ConversationStream` (the streaming shell over this core)
differ only in where a frame's input comes from (a slice of the whole-signal
perception, or PCM through the streaming encoder) and in how they hand the
events out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import numpy as np

from .events import (
    AssistantTextDelta,
    AudioFrames,
    Event,
    FunctionDelta,
    TokenText,
    ToolsWarning,
    TurnEnded,
    UserTranscriptDelta,
)
from .compute import ConversationState, FrameOutput, PerceptionSource, advance, finish_audio
from .options import ConversationOptions
from .profile import FrameClock, Profile, profile_env
from .prompt import session_prompt
from .reservation import ConversationShape, context_frames
from .timeline import TimelineStep
from .tool_calls import ToolChannel
from .tools import ToolError

if TYPE_CHECKING:
    from .voicechat import VoiceChat

# A conversation's cumulative texts (the events' ``text``: assistant text, function
# channel, user transcript) keep their last 16 K characters once past 32 K.
TEXT_KEEP_CHARS = 16 * 1024


class Conversation:
    def __init__(self, parent: "VoiceChat", options: ConversationOptions,
                 perception: PerceptionSource, defer_start: bool = False):
        model, config = parent.model, parent.config
        self.model = model
        self.options = options
        self._prompt_cache = parent.prompt_cache
        prompt, toolset = session_prompt(parent.tokenizer, model, options)
        start = parent.warm_start
        # The attention caches' shape: the prompt's positions and the bounded context.
        self.shape = ConversationShape(len(prompt), start.positions,
                                  context_frames(options.context_seconds, config.frame_duration))
        self.compute = ConversationState(
            model, perception, parent.new_rnnt_state(), start=start,
            seed=options.seed, use_language_cache=options.use_language_cache,
            context=self.shape.windows(), top_p=options.top_p,
        )
        hidden = config.special_text_ids
        self.text = TokenText(parent.tokenizer, hidden, TEXT_KEEP_CHARS)
        self.function = TokenText(parent.tokenizer, hidden, TEXT_KEEP_CHARS)
        self.compute.rnnt.keep_chars = TEXT_KEEP_CHARS
        codec = model.tts_model.audio_codec
        self.audio = AudioFrames(codec.samples_per_frame, config.output_sample_rate)
        self._turn_end_id = config.eos_token_id if options.turn_events else None
        self.tools = None if toolset is None else ToolChannel(
            toolset, parent.tokenizer, max_calls_per_turn=options.max_tool_calls_per_turn)
        self._notices: list[Event] = [ToolsWarning(0, message) for message in (
            toolset.warnings if toolset is not None else ())]
        sub_stages, self._frames_path = profile_env()
        self.clock = FrameClock(options.profile, sub_stages)
        self.profile = Profile(frame_duration_ms=config.frame_duration * 1000.0)
        self.frame_index = 0
        self._updates: tuple | Exception | None = None
        self.last_output: FrameOutput | None = None
        # The system prompt advances the timeline but emits nothing; with
        # ``defer_start`` the caller runs :meth:`start_steps` to the end.
        self.prompt_cache_hit = False
        self._start = self._starting(prompt)
        if not defer_start:
            for _ in self._start:
                pass

    def _starting(self, prompt: list[int]) -> Iterator[int]:
        """Prefill the prompt (yielding the positions left), or continue from the
        runtime's cached state for it (a ``state`` / ``meta_state`` round trip)."""
        compute, options, cache = self.compute, self.options, self._prompt_cache
        cached = prompt and options.use_language_cache and cache is not None and cache.max_bytes
        key = (tuple(prompt), options.seed, self.shape.recent)  # the rings' sizes too
        snapshot = cache.get(key) if cached else None
        if snapshot is not None:
            compute.restore(*snapshot)
            self.prompt_cache_hit = True
            return
        yield from compute.timeline.prefill_steps(prompt)
        if cached:
            cache.put(key, (compute.state, compute.meta_state))

    def start_steps(self) -> Iterator[int]:
        """The deferred start (see ``defer_start``)."""
        return self._start

    # --- one frame ---------------------------------------------------------

    def frame(self, frame_input: object) -> list[Event]:
        """Advance one frame (PCM, or a frame index of a whole signal); its events."""
        self.clock.start(self.frame_index)
        try:
            out = advance(self.model, self.compute, frame_input, forced=self.next_forced(),
                          clock=self.clock, on_tokens=self.decode_tokens)
            events = self.finish_frame(out)
        except BaseException:
            self.clock.abandon()  # stop counting syncs for a frame that failed
            raise
        timing = self.clock.finish()
        if timing is not None:
            self.profile.frames.append(timing)
        return events

    def next_forced(self) -> int | None:
        """The function token this frame is forced to (a queued tool result's next token)."""
        return None if self.tools is None else self.tools.next_forced()

    def decode_tokens(self, step: TimelineStep) -> None:
        """Host text work, done while the frame's speech half computes.

        A failure is kept for :meth:`finish_frame` to raise, so that in a
        batch it fails this conversation only.
        """
        try:
            function = None if step.function_forced else self.function.append(step.function_id)
            self._updates = (self.text.append(step.text_id), function)
        except Exception as exc:
            self._updates = exc

    def finish_frame(self, out: FrameOutput) -> list[Event]:
        """Turn a computed frame into its events and move to the next frame."""
        updates, self._updates = self._updates, None
        if isinstance(updates, Exception):
            raise updates
        events = self._events(self.frame_index, out, updates)
        self.last_output = out
        self.frame_index += 1
        return events

    def _events(self, index: int, out: FrameOutput, updates: tuple | None) -> list[Event]:
        """The frame's events in the reference's order: audio, transcript, text, function."""
        text_update, function_update = updates or (None, None)
        events, self._notices = self._notices, []
        finished = self.audio.push(index, out.codes, out.samples)
        if finished is not None:
            events.append(finished)
        rnnt = self.compute.rnnt
        delta = rnnt.commit(out.symbols)
        if delta is not None:
            events.append(UserTranscriptDelta(index, delta, rnnt.text))
            if self.tools is not None:
                self.tools.new_turn()
        if text_update is not None:
            events.append(AssistantTextDelta(index, out.text_id, *text_update))
        elif out.text_id == self._turn_end_id:
            events.append(TurnEnded(index))
        if out.function_forced:
            assert self.tools is not None  # only tool results are forced
            events.extend(self.tools.forced(index))
        elif function_update is not None:
            events.append(FunctionDelta(index, out.function_id, *function_update))
            if self.tools is not None:
                events.extend(self.tools.observe(self.function.text, index,
                                                 self.function.dropped))
        return events

    # --- the end -------------------------------------------------------------

    def end(self) -> list[Event]:
        """The input ended: the last frame's audio, then an open tool block as unterminated."""
        events = self.finish_audio()
        if self.tools is not None:
            events.extend(self.tools.finish(self.function.text, max(self.frame_index - 1, 0)))
        return events

    def finish_audio(self) -> list[Event]:
        """The last frame's ``Audio``, completed with the codec's held tail."""
        if not self.frame_index:
            return []
        audio = self.audio.finish(finish_audio(self.model, self.compute))
        return [] if audio is None else [audio]

    def close(self) -> None:
        """Release the compute state; write the profile's frames when asked to."""
        self.compute.release()
        if self._frames_path and self.profile.frames:
            self.profile.write_frames(self._frames_path)

    # --- tools -----------------------------------------------------------------

    def submit_tool_result(self, call_id: str, output: str) -> int:
        """Queue a call's result: its tokens enter the next frames' function input.

        Returns the number of tokens queued. :class:`ToolError` when no tools
        are registered, for an unknown or already answered ``call_id``, and for
        non-ASCII output.
        """
        if self.tools is None:
            raise ToolError("no tools are registered for this session (tools_not_set)")
        return self.tools.submit(call_id, output)

    @property
    def transcript(self) -> str:
        return self.compute.rnnt.text


def joined_audio(events: list[Event]) -> tuple[np.ndarray, np.ndarray]:
    """The samples and codes of a conversation's ``Audio`` events, in frame order."""
    from .events import Audio

    frames = [e for e in events if isinstance(e, Audio)]
    if not frames:
        return np.zeros((0,), np.float32), np.zeros((0, 0), np.int32)
    return (np.concatenate([a.samples for a in frames]),
            np.stack([a.audio_codes for a in frames]))
