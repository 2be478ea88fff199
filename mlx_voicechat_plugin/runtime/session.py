"""Offline voice chat: one whole user turn in, one whole answer out."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from ..models.model import Model
from ..models.rnnt import GreedyRNNT, RNNTState, transcribe
from .audio import AudioInput, load_waveform
from .events import TokenText, ToolCall, ToolCallInvalid
from .timeline import Timeline, replace_control_codes
from .tool_calls import ToolChannel, tool_prompt

logger = logging.getLogger(__name__)

MAX_INPUT_SECONDS = 20 * 60.0
MAX_EXTRA_DECODING_SECONDS = 600.0


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


def _tokenizer_of(processor: Any) -> Any:
    tokenizer = getattr(processor, "tokenizer", processor)
    missing = [n for n in ("encode", "decode", "get_vocab") if not hasattr(tokenizer, n)]
    if missing:
        raise TypeError(f"processor: tokenizer lacks {', '.join(missing)}")
    return tokenizer


class VoiceChatSession:
    """Binds a model to its tokenizer; makes offline turns and streaming sessions."""

    def __init__(self, model: Model, processor: Any):
        self.model = model
        self.config = model.config
        self.tokenizer = _tokenizer_of(processor)
        if getattr(model, "prepared_for", None) is not self.tokenizer:
            model.prepare(self.tokenizer)  # a model not made by ``load``
        stt = model.stt_model
        self._rnnt = GreedyRNNT(
            stt.rnnt_decoder,
            stt.rnnt_joint,
            blank_id=self.config.rnnt_blank_id,
            max_symbols=self.config.audio_config.max_symbols,
        )

    def decode_text(self, ids: list[int] | np.ndarray) -> str:
        special = self.config.special_text_ids
        kept = [int(i) for i in ids if int(i) not in special]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def new_rnnt_state(self) -> RNNTState:
        return RNNTState(self._rnnt, list(self.config.rnnt_vocabulary))

    def create_streaming_session(self, options: Any = None, **kwargs: Any):
        from .streaming import StreamingOptions, StreamingSession

        if options is None:
            options = StreamingOptions(**kwargs)
        elif kwargs:
            raise TypeError("pass either StreamingOptions or keyword options, not both")
        return StreamingSession(self, options)

    def generate(
        self,
        audio: AudioInput,
        *,
        system_prompt: str | None = None,
        extra_decoding_seconds: float = 3.0,
        seed: int = 0,
        use_language_cache: bool = True,
        sample_rate: int | None = None,
        tools: list[dict] | None = None,
        tool_response: str | list[str] | None = None,
    ) -> VoiceChatResult:
        """Answer one user turn. The same inputs and seed give identical output.

        With ``tools`` the system prompt carries the tool block and calls are
        parsed from the function channel. ``tool_response`` is the second pass
        of the offline flow: rerun the same turn (same seed) and each result,
        in order, is injected right after the corresponding valid call.
        """
        config = self.config
        responses = [tool_response] if isinstance(tool_response, str) else list(tool_response or [])
        if responses and tools is None:
            raise ValueError("tool_response needs tools (tools_not_set)")
        prompt, toolset = tool_prompt(self.tokenizer, self.model, system_prompt, tools)
        rate = config.input_sample_rate
        if not 0 <= extra_decoding_seconds <= MAX_EXTRA_DECODING_SECONDS:
            raise ValueError(
                "extra_decoding_seconds must be within "
                f"[0, {MAX_EXTRA_DECODING_SECONDS:g}] s, got {extra_decoding_seconds}"
            )
        waveform = load_waveform(audio, rate, sample_rate)
        seconds = waveform.shape[0] / rate
        if seconds > MAX_INPUT_SECONDS:
            raise ValueError(
                f"audio is {seconds:.1f} s; offline turns take at most "
                f"{MAX_INPUT_SECONDS:g} s of input"
            )
        if extra_decoding_seconds:
            waveform = mx.pad(waveform, (0, round(extra_decoding_seconds * rate)))

        stt = self.model.stt_model
        from ..models.perception import log_mel

        mel = log_mel(waveform, config.audio_config)
        projected, lengths, encoded = stt.perception(mel)
        mx.eval(projected, encoded)
        frames = int(lengths[0])
        logger.info("offline turn: %.2f s input, %d frames", seconds, frames)

        timeline = Timeline(self.model, seed=seed, use_language_cache=use_language_cache)
        timeline.prefill(prompt)
        channel = None if toolset is None else ToolChannel(toolset, self.tokenizer)
        visible = TokenText(self.tokenizer, config.special_text_ids)
        calls: list[ToolCall] = []
        errors: list[ToolCallInvalid] = []

        text_ids, function_ids, codes = [], [], []
        for t in range(frames):
            forced = None if channel is None else channel.next_forced()
            step = timeline.step(projected[:, t : t + 1], force_function=forced)
            text_ids.append(step.text_id)
            function_ids.append(step.function_id)
            codes.append(step.codes)
            if channel is None:
                continue
            if step.function_forced:
                channel.forced(t)
            elif visible.append(step.function_id) is not None:
                for event in channel.observe(visible.text, t):
                    if isinstance(event, ToolCall):
                        calls.append(event)
                        if responses:
                            channel.submit(event.call_id, responses.pop(0))
                    else:
                        errors.append(event)
        if channel is not None:
            errors += channel.finish(visible.text, frames - 1)
        answer = replace_control_codes(self.model, mx.concatenate(codes, axis=1))
        waveform_out = self.model.tts_model.audio_codec.decode(answer.transpose(0, 2, 1))
        mx.eval(waveform_out)

        rnnt = self.new_rnnt_state()
        transcript = transcribe(encoded, rnnt)
        return VoiceChatResult(
            text=self.decode_text(text_ids),
            function_text=self.decode_text(function_ids) if channel is None else visible.text,
            user_transcript=transcript,
            audio=np.array(waveform_out[0, 0], dtype=np.float32),
            sample_rate=config.output_sample_rate,
            text_tokens=np.array(text_ids, dtype=np.int32),
            function_tokens=np.array(function_ids, dtype=np.int32),
            audio_codes=np.array(answer[0], dtype=np.int32),
            tool_calls=calls,
            tool_errors=errors,
        )
