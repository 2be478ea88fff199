"""A loaded model bound to its tokenizer: offline turns, and the streams it makes.

:class:`VoiceChat` (``VoiceChat(model, processor)``, or
``model.create_session(processor)``) holds what the model's sessions share (the tokenizer, the
greedy RNNT and the streaming encoder, whose graphs compile once) and makes
streaming sessions and transcript-only streams.

Offline, the layering is mlx-lm's: :meth:`VoiceChat.stream_generate` runs the
conversation one frame at a time and yields each frame's events (the same
:class:`~.conversation.Conversation` a streaming session drives, over the
whole-signal perception instead of the streaming encoder);
:meth:`VoiceChat.generate` collects them into a :class:`VoiceChatResult`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import mlx.core as mx
import numpy as np

from ..models.perception.encoder_stream import EncoderStream
from ..models.model import Model
from ..models.perception.perception_stream import PerceptionStream
from ..models.rnnt.rnnt import GreedyRNNT, RNNTState
from .audio import AudioInput, load_waveform
from .conversation import Conversation, joined_audio
from .events import Done, Event, FunctionDelta, ToolCall, ToolCallInvalid, UserTranscriptDelta
from .compute import FrameOutput, WholeSignal
from .options import (
    DEFAULT_EXTRA_DECODING_SECONDS,
    MAX_INPUT_SECONDS,
    ConversationOptions,
    TranscriptionOptions,
    check_extra_decoding_seconds,
)
from .prompt_cache import PromptCache
from .warm_start import WarmStart

logger = logging.getLogger(__name__)


@dataclass
class VoiceChatResult:
    text: str
    function_text: str
    user_transcript: str | None
    audio: np.ndarray  # float32 at ``sample_rate``
    sample_rate: int
    text_tokens: np.ndarray  # (frames,) int32
    function_tokens: np.ndarray  # (frames,) int32
    audio_codes: np.ndarray  # (frames, Q) int32, control codes replaced
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_errors: list[ToolCallInvalid] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)  # as a streaming session emits them


@dataclass
class FrameResult:
    """One frame of an offline turn: its outputs and events (``output`` is ``None``
    for the closing item, whose events end the turn: the last audio, then ``Done``)."""

    frame_index: int
    output: FrameOutput | None
    events: list[Event]


def _options(kind: type, options: Any, kwargs: dict[str, Any]) -> Any:
    """``options`` (a ``kind``), or one made of the keyword options; not both."""
    if options is None:
        return kind(**kwargs)
    if kwargs:
        raise TypeError(f"pass either {kind.__name__} or keyword options, not both")
    return options


class VoiceChat:
    """Binds a loaded model to its tokenizer; runs offline turns and makes streams.

    The model is only read: its one-time setup (the TTS's subword spellings,
    codebook tables) is done by ``load``. What the runtime keeps is here, not
    on the model: the EAR-TTS warm start every conversation begins from
    (computed once, when this is made), the prompt cache and the measured size
    of a conversation's fixed state.
    """

    def __init__(self, model: Model, processor: Any):
        self.model = model
        self.config = model.config
        self.tokenizer = getattr(processor, "tokenizer", processor)
        missing = [n for n in ("encode", "decode", "get_vocab") if not hasattr(self.tokenizer, n)]
        if missing:
            raise TypeError(f"processor: tokenizer lacks {', '.join(missing)}")
        if getattr(model, "prepared_for", None) is not self.tokenizer:
            raise ValueError(
                "processor: the model was not prepared for this tokenizer; load both with "
                "mlx_voicechat_plugin.load(path), or call model.prepare(tokenizer) once"
            )
        stt = model.stt_model
        self._rnnt = GreedyRNNT(
            stt.rnnt_decoder,
            stt.rnnt_joint,
            blank_id=self.config.rnnt_blank_id,
            max_symbols=self.config.audio_config.max_symbols,
            hold_f32=model.holds_f32,
        )
        perception = stt.perception
        self._encoder = EncoderStream(perception.encoder, left_context=perception.att_context[0],
                                      positions=perception.window_positions(
                                          getattr(model, "checkpoint_path", None)))
        self.prompt_cache: PromptCache | None = PromptCache()
        self._warm_start: WarmStart | None = WarmStart.of(model)
        # A conversation's non-KV state bytes, measured once on a probe stream the first
        # time a pool reserves for one (:class:`~.reservation.Reservations`).
        self.fixed_state_bytes: int | None = None

    @property
    def warm_start(self) -> WarmStart:
        """What every conversation's EAR-TTS starts from (set ``None`` to recompute it)."""
        if self._warm_start is None:
            self._warm_start = WarmStart.of(self.model)
        return self._warm_start

    @warm_start.setter
    def warm_start(self, start: WarmStart | None) -> None:
        self._warm_start = start

    def new_rnnt_state(self) -> RNNTState:
        return RNNTState(self._rnnt, list(self.config.rnnt_vocabulary))

    def new_perception_stream(self, use_cache: bool = True) -> PerceptionStream:
        """A new stream's perception state, on this model's streaming encoder."""
        return PerceptionStream(self.model.stt_model.perception, self.config, use_cache,
                                self._encoder)

    def create_streaming_session(self, options: ConversationOptions | None = None,
                                 defer_start: bool = False, framed_by_caller: bool = False,
                                 **kwargs: Any):
        """A streaming session; ``defer_start``: its prompt prefill is left to
        :meth:`~.streaming.StreamingShell.start_steps`; ``framed_by_caller``: it is handed
        whole frames (a pool's session) and holds no framer."""
        from .streaming import ConversationStream

        return ConversationStream(self, _options(ConversationOptions, options, kwargs),
                                  defer_start, framed_by_caller)

    def create_transcription_stream(self, options: TranscriptionOptions | None = None,
                                    framed_by_caller: bool = False, **kwargs: Any):
        """A transcript-only stream (perception and the RNNT); ``framed_by_caller`` as for
        :meth:`create_streaming_session`."""
        from .transcribe import TranscriptionStream

        return TranscriptionStream(self, _options(TranscriptionOptions, options, kwargs),
                                   framed_by_caller)

    # --- offline ---------------------------------------------------------------

    def _whole_signal(self, audio: AudioInput, sample_rate: int | None,
                      extra_decoding_seconds: float) -> tuple[WholeSignal, int]:
        """The turn's perception over the whole (padded) signal, and its frame count."""
        rate = self.config.input_sample_rate
        check_extra_decoding_seconds(extra_decoding_seconds)
        waveform = load_waveform(audio, rate, sample_rate)
        seconds = waveform.shape[0] / rate
        if seconds > MAX_INPUT_SECONDS:
            raise ValueError(
                f"audio is {seconds:.1f} s; offline turns take at most "
                f"{MAX_INPUT_SECONDS:g} s of input"
            )
        if extra_decoding_seconds:
            waveform = mx.pad(waveform, (0, round(extra_decoding_seconds * rate)))
        projected, lengths, encoded = self.model.stt_model.perception.encode_signal(waveform)
        mx.eval(projected, encoded, lengths)
        frames = int(lengths[0])
        logger.info("offline turn: %.2f s input, %d frames", seconds, frames)
        return WholeSignal(projected, encoded), frames

    def stream_generate(
        self,
        audio: AudioInput,
        options: ConversationOptions | None = None,
        *,
        extra_decoding_seconds: float = DEFAULT_EXTRA_DECODING_SECONDS,
        sample_rate: int | None = None,
        tool_response: str | list[str] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        **kwargs: Any,
    ) -> Iterator[FrameResult]:
        """Answer one user turn frame by frame: one :class:`FrameResult` per frame, then
        the closing one. Keyword options are :class:`ConversationOptions` fields;
        ``on_progress(frames_done, frames_total)`` is called after each frame.

        ``tool_response`` is the second pass of the offline flow: rerun the
        same turn (same seed) and each result, in order, is injected right
        after the corresponding valid call.
        """
        options = _options(ConversationOptions, options, kwargs)
        responses = [tool_response] if isinstance(tool_response, str) else list(tool_response or [])
        if responses and options.tools is None:
            raise ValueError("tool_response needs tools (tools_not_set)")
        signal, frames = self._whole_signal(audio, sample_rate, extra_decoding_seconds)
        conversation = Conversation(self, options, signal)
        try:
            for t in range(frames):
                events = conversation.frame(t)
                for event in events:
                    if isinstance(event, ToolCall) and responses:
                        conversation.submit_tool_result(event.call_id, responses.pop(0))
                if on_progress is not None:
                    on_progress(t + 1, frames)
                yield FrameResult(t, conversation.last_output, events)
            yield FrameResult(frames, None, [*conversation.end(), Done(frames)])
        finally:
            conversation.close()

    def generate(self, audio: AudioInput, options: ConversationOptions | None = None,
                 **kwargs: Any) -> VoiceChatResult:
        """Answer one user turn. The same inputs and seed give identical output.

        Takes :meth:`stream_generate`'s arguments. With ``tools`` the system
        prompt carries the tool block and calls are parsed from the function
        channel; ``result.events`` holds every event a streaming session of
        the same turn emits.
        """
        text_ids: list[int] = []
        function_ids: list[int] = []
        events: list[Event] = []
        for item in self.stream_generate(audio, options, **kwargs):
            if item.output is not None:
                text_ids.append(item.output.text_id)
                function_ids.append(item.output.function_id)
            events.extend(item.events)
        samples, codes = joined_audio(events)
        transcript = next((e.text for e in reversed(events) if isinstance(e, UserTranscriptDelta)), "")
        function = next((e.text for e in reversed(events) if isinstance(e, FunctionDelta)), "")
        special = self.config.special_text_ids
        return VoiceChatResult(
            text=self.tokenizer.decode([i for i in text_ids if i not in special],
                                       skip_special_tokens=False),
            function_text=function,
            user_transcript=transcript,
            audio=samples,
            sample_rate=self.config.output_sample_rate,
            text_tokens=np.array(text_ids, dtype=np.int32),
            function_tokens=np.array(function_ids, dtype=np.int32),
            audio_codes=codes,
            tool_calls=[e for e in events if isinstance(e, ToolCall)],
            tool_errors=[e for e in events if isinstance(e, ToolCallInvalid)],
            events=events,
        )

