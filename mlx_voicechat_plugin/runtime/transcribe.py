"""Transcription only: perception and the RNNT branch, no LLM, TTS or codec.

The checkpoint's cache-aware FastConformer and its RNNT decoder transcribe the
user; in a conversation that transcript is a by-product of the full frame.
Here they run alone, from the same loaded weights:

- :meth:`Transcriber.steps` / :meth:`Transcriber.transcribe`: a whole file,
  run through the same streaming frame as a :class:`TranscriptionStream`
  (the streaming mel frontend, the cache-aware encoder step and the RNNT, one
  80 ms frame at a time from carried state, the partial last frame
  zero-padded), so the text equals that stream's on the same samples, and
  the device memory it holds is the encoder's bounded windows whatever the
  file's length (the host holds the file's decoded PCM). ``steps`` is a
  generator that yields each chunk's transcript deltas, so a caller (the
  server's engine) can interleave other work and stream them; ``on_progress``
  hears each chunk's frames done and the file's total.
- :class:`TranscriptionStream`: the text-only realtime session, the streaming
  shell (:class:`~.streaming.StreamingShell`) over a :class:`TranscriptCore`.
  Per 80 ms frame the core runs the streaming mel frontend, the encoder step
  and the RNNT frame only, through the same batched frame as a full
  conversation's hearing half (:func:`~.compute.advance_batch`), so its
  transcript equals a full session's on the same input, and in a session pool
  its rows join the other sessions' perception and RNNT batches. It emits
  runtime events (:class:`UserTranscriptDelta`, one :class:`TranscriptDone` at
  ``flush``, then :class:`Done`); the server's protocol layer serialises them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.nemotron_asr import tokenizer as sp_vocab

from ..models.perception.perception_stream import PerceptionStream
from ..models.rnnt.rnnt import RNNTState
from .audio import AudioInput, read_samples
from .events import Event, TranscriptDone, UserTranscriptDelta
from .compute import Heard, advance
from .hearing import HearingRow
from .options import TranscriptionOptions, check_positive_int
from .streaming import StreamingShell, TranscriptLimit

if TYPE_CHECKING:
    from .voicechat import VoiceChat

__all__ = ["Transcriber", "TranscriptionOptions", "TranscriptionStream", "TranscriptCore",
           "TranscriptDone", "TranscriptLimit", "Transcription", "checkpoint_language"]

logger = logging.getLogger(__name__)

CHUNK_FRAMES = 25  # a file's streaming frames per step (2 s of audio)
DEFAULT_LANGUAGE = "en"  # the released checkpoint's language when config.json names none


def checkpoint_language(config: Any) -> str:
    """The language the checkpoint transcribes (``language`` in config.json, else English)."""
    language = getattr(config, "language", None)
    return language if isinstance(language, str) and language else DEFAULT_LANGUAGE


@dataclass(frozen=True)
class Transcription:
    text: str
    tokens: list[int]
    duration: float  # the file's seconds
    frames: int  # 80 ms frames decoded: the file's (the last one partial) unless ``truncated``
    truncated: bool  # the output reached ``max_new_tokens``


class Transcriber:
    """Transcription from a loaded VoiceChat model's perception and RNNT."""

    def __init__(self, voicechat: "VoiceChat"):
        self.voicechat = voicechat
        self.config = voicechat.config
        self.sample_rate = self.config.input_sample_rate
        self.language = checkpoint_language(self.config)

    def steps(
        self,
        audio: AudioInput,
        *,
        max_new_tokens: int | None = None,
        sample_rate: int | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Generator[list[Event], None, Transcription]:
        """Transcribe ``audio`` step by step; yields each step's deltas, returns the result.

        The first step reads the file; each later one runs :data:`CHUNK_FRAMES`
        streaming frames (perception and the RNNT of each, evaluated with the
        carried state), then calls ``on_progress(frames_done, frames_total)``.
        """
        if max_new_tokens is not None:
            check_positive_int(max_new_tokens, "max_new_tokens")
        samples = read_samples(audio, self.sample_rate, sample_rate)
        duration = samples.shape[0] / self.sample_rate
        size = self.config.frame_samples
        frames = -(-samples.shape[0] // size)
        logger.info("transcription: %.2f s input, %d frames", duration, frames)
        core = TranscriptCore(self.voicechat, TranscriptionOptions(), max_new_tokens)
        try:
            yield []
            while core.frame_index < frames and core.compute.rnnt.enabled and not core.full:
                deltas: list[Event] = []
                for t in range(core.frame_index, min(core.frame_index + CHUNK_FRAMES, frames)):
                    frame = samples[t * size : (t + 1) * size]
                    if frame.shape[0] < size:  # the partial last frame, as a stream's flush
                        frame = np.pad(frame, (0, size - frame.shape[0]))
                    deltas += core.frame(frame)
                    if core.full:
                        break
                if on_progress is not None:
                    on_progress(core.frame_index, frames)
                yield deltas
            rnnt = core.compute.rnnt
            return Transcription(rnnt.text, list(rnnt.tokens), duration, core.frame_index,
                                 core.full)
        finally:
            core.close()

    def transcribe(self, audio: AudioInput, **options: Any) -> Transcription:
        """:meth:`steps` run to the end."""
        steps = self.steps(audio, **options)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def create_stream(self, options: TranscriptionOptions | None = None,
                      framed_by_caller: bool = False, **kwargs: Any) -> "TranscriptionStream":
        """:meth:`~.voicechat.VoiceChat.create_transcription_stream`."""
        return self.voicechat.create_transcription_stream(options, framed_by_caller, **kwargs)


class HearingState(HearingRow):
    """A transcript-only stream's carried state: its perception stream and RNNT state
    (the rows of the hearing half, as in a :class:`~.compute.ConversationState`)."""

    def __init__(self, perception: PerceptionStream, rnnt: RNNTState):
        self.perception: PerceptionStream | None = perception
        self.rnnt = rnnt

    @property
    def state(self) -> list[mx.array]:
        self.check_own()
        perception = self.perception
        return [] if perception is None else [*perception.state, *self.rnnt.state]

    def release(self) -> None:
        """Drop every array reference (the transcript stays readable)."""
        self.check_own()
        self.perception = None
        self.rnnt.release()


class TranscriptCore:
    """The transcript-only core of a streaming shell: perception and the RNNT, as the
    full conversation runs them (the same batched frame, without its speaking half);
    ``max_tokens``: the transcript keeps at most that many tokens."""

    decode_tokens = None  # no language model: no token texts to decode

    def __init__(self, voicechat: "VoiceChat", options: TranscriptionOptions,
                 max_tokens: int | None = None):
        self.model = voicechat.model
        self.compute = HearingState(voicechat.new_perception_stream(options.use_perception_cache),
                                      voicechat.new_rnnt_state())
        self.frame_index = 0
        self.max_tokens = max_tokens

    @property
    def full(self) -> bool:
        """The transcript holds ``max_tokens`` tokens."""
        return self.max_tokens is not None and len(self.compute.rnnt.tokens) >= self.max_tokens

    @property
    def transcript(self) -> str:
        return self.compute.rnnt.text

    def start_steps(self) -> Iterator[int]:
        return iter(())  # nothing to prefill

    def next_forced(self) -> None:
        return None

    def frame(self, frame: np.ndarray) -> list[Event]:
        """Perception and the RNNT for one frame of PCM, alone (one row)."""
        return self.finish_frame(advance(self.model, self.compute, frame))

    def finish_frame(self, out: Heard) -> list[Event]:
        rnnt, before = self.compute.rnnt, self.compute.rnnt.text
        delta = rnnt.commit(out.symbols)
        if self.max_tokens is not None and len(rnnt.tokens) > self.max_tokens:
            del rnnt.tokens[self.max_tokens :]
            rnnt.text = sp_vocab.decode(rnnt.tokens, rnnt.vocabulary).strip()
            kept = rnnt.text[len(before) :] if rnnt.text.startswith(before) else rnnt.text
            delta = kept or None
        events: list[Event] = []
        if delta is not None:
            events.append(UserTranscriptDelta(self.frame_index, delta, rnnt.text))
        self.frame_index += 1
        return events

    def end(self) -> list[Event]:
        """Exactly one final transcript, also for an empty stream."""
        return [TranscriptDone(self.frame_index, self.transcript)]

    def finish_audio(self) -> list[Event]:
        return []  # no audio

    def close(self) -> None:
        self.compute.release()


class TranscriptionStream(StreamingShell):
    """A text-only realtime session: PCM in, the user transcript out (the streaming
    shell over a :class:`TranscriptCore`). ``flush`` ends with one
    :class:`TranscriptDone`, then ``Done``; audio after it raises ``StreamClosed``."""

    def __init__(self, voicechat: "VoiceChat", options: TranscriptionOptions,
                 framed_by_caller: bool = False):
        super().__init__(TranscriptCore(voicechat, options), options, voicechat.config,
                         framed_by_caller)

    @property
    def state(self) -> list[mx.array]:
        """The carried arrays: the streaming encoder's caches and the RNNT carry."""
        return self.core.compute.state
