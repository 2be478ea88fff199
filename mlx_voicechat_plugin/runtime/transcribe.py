"""Transcription only: perception and the RNNT branch, no LLM, TTS or codec.

The checkpoint's cache-aware FastConformer and its RNNT decoder transcribe the
user; in a conversation that transcript is a by-product of the full frame.
Here they run alone, from the same loaded weights:

- :meth:`Transcriber.steps` / :meth:`Transcriber.transcribe`: a whole file,
  with no appended seconds: whole-signal perception over the file alone and
  greedy RNNT over its frames, so the text equals the reference's offline
  transcript with ``extra_decoding_seconds=0`` (and ours,
  ``generate(..., extra_decoding_seconds=0).user_transcript``). The end of the
  file is the end of input: the encoder runs over the whole file at once, so
  its residual window is flushed by construction (the centred STFT's last
  frame sits on the file's edge, the subsampling keeps a partial last frame;
  the checkpoint's attention has no right context) and the last real frame's
  output exists without padding; one :class:`Transcription` is the one final.
  ``steps`` is a generator that yields each chunk's transcript deltas, so a
  caller (the server's engine) can interleave other work and stream them.
- :class:`TranscriptionStream`: the text-only realtime session, the streaming
  shell (:class:`~.streaming.StreamingShell`) over a :class:`TranscriptCore`.
  Per 80 ms frame the core runs the streaming mel frontend, the encoder step
  and the RNNT frame only, through the same batched frame as a full
  conversation's listening half (:func:`~.compute.advance_batch`), so its
  transcript equals a full session's on the same input, and in a session pool
  its rows join the other sessions' perception and RNNT batches. It emits
  runtime events (:class:`UserTranscriptDelta`, one :class:`TranscriptDone` at
  ``flush``, then :class:`Done`); the server's protocol layer serialises them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator, Iterator

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.nemotron_asr import tokenizer as sp_vocab

from ..models.perception_stream import PerceptionStream
from ..models.rnnt import RNNTState
from .audio import AudioInput, load_waveform
from .events import Event, TranscriptDone, UserTranscriptDelta
from .compute import Heard, advance
from .hearing import ListeningRow
from .options import TranscriptionOptions, check_positive_int
from .streaming import StreamingShell, TranscriptLimit

if TYPE_CHECKING:
    from .voicechat import VoiceChat

__all__ = ["Transcriber", "TranscriptionOptions", "TranscriptionStream", "TranscriptCore",
           "TranscriptDone", "TranscriptLimit", "Transcription", "checkpoint_language"]

logger = logging.getLogger(__name__)

RNNT_CHUNK_FRAMES = 25  # a file's RNNT frames queued per evaluation
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
    frames: int  # encoder frames of the file (decoded unless ``truncated``)
    truncated: bool  # the output reached ``max_new_tokens``


class _Limited:
    """Commits RNNT symbols into ``state``, keeping at most ``limit`` tokens."""

    def __init__(self, state: RNNTState, limit: int | None):
        self.state = state
        self.limit = limit

    @property
    def full(self) -> bool:
        return self.limit is not None and len(self.state.tokens) >= self.limit

    def commit(self, symbols: mx.array | None) -> str | None:
        state, before = self.state, self.state.text
        delta = state.commit(symbols)
        if self.limit is None or len(state.tokens) <= self.limit:
            return delta
        del state.tokens[self.limit :]
        state.text = sp_vocab.decode(state.tokens, state.vocabulary).strip()
        delta = state.text[len(before) :] if state.text.startswith(before) else state.text
        return delta or None


class Transcriber:
    """Transcription from a loaded VoiceChat model's perception and RNNT."""

    def __init__(self, voicechat: "VoiceChat"):
        self.voicechat = voicechat
        self.model = voicechat.model
        self.config = voicechat.config
        self.sample_rate = self.config.input_sample_rate
        self.language = checkpoint_language(self.config)

    def steps(
        self,
        audio: AudioInput,
        *,
        max_new_tokens: int | None = None,
        sample_rate: int | None = None,
    ) -> Generator[list[UserTranscriptDelta], None, Transcription]:
        """Transcribe ``audio`` step by step; yields each step's deltas, returns the result.

        The first step runs perception over the whole file (nothing appended);
        each later one decodes :data:`RNNT_CHUNK_FRAMES` encoder frames.
        """
        if max_new_tokens is not None:
            check_positive_int(max_new_tokens, "max_new_tokens")
        rate = self.sample_rate
        waveform = load_waveform(audio, rate, sample_rate)
        duration = waveform.shape[0] / rate
        _, lengths, encoded = self.model.stt_model.perception.encode_signal(waveform)
        mx.eval(encoded, lengths)  # the projection to the LLM is never evaluated
        frames = int(lengths[0])
        logger.info("transcription: %.2f s input, %d frames", duration, frames)
        state = self.voicechat.new_rnnt_state()
        limited = _Limited(state, max_new_tokens)
        yield []
        t = 0
        while t < frames and state.enabled and not limited.full:
            stop = min(t + RNNT_CHUNK_FRAMES, frames)
            pending = [state.advance(encoded[:, i : i + 1]) for i in range(t, stop)]
            mx.eval(*pending, *state.state)
            deltas = []
            for offset, symbols in enumerate(pending):
                delta = limited.commit(symbols)
                if delta is not None:
                    deltas.append(UserTranscriptDelta(t + offset, delta, state.text))
                if limited.full:
                    break
            t = stop
            yield deltas
        return Transcription(state.text, list(state.tokens), duration, frames, limited.full)

    def transcribe(self, audio: AudioInput, **options: Any) -> Transcription:
        """:meth:`steps` run to the end."""
        steps = self.steps(audio, **options)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def create_stream(self, options: TranscriptionOptions | None = None,
                      **kwargs: Any) -> "TranscriptionStream":
        if options is None:
            options = TranscriptionOptions(**kwargs)
        elif kwargs:
            raise TypeError("pass either TranscriptionOptions or keyword options, not both")
        return TranscriptionStream(self.voicechat, options)


class ListeningState(ListeningRow):
    """A transcript-only stream's carried state: its perception stream and RNNT state
    (the rows of the listening half, as in a :class:`~.compute.ConversationState`)."""

    def __init__(self, perception: PerceptionStream, rnnt: RNNTState):
        self.perception: PerceptionStream | None = perception
        self.rnnt = rnnt

    @property
    def state(self) -> list[mx.array]:
        self.check_own()
        perception = self.perception
        return [] if perception is None else [*perception.state, *self.rnnt.state]

    @property
    def nbytes(self) -> int:
        return self.listening_nbytes()

    def release(self) -> None:
        """Drop every array reference (the transcript stays readable)."""
        self.leave_batches()
        self.perception = None
        self.rnnt.release()


class TranscriptCore:
    """The transcript-only core of a streaming shell: perception and the RNNT, as the
    full conversation runs them (the same batched frame, without its speaking half)."""

    decode_tokens = None  # no language model: no token texts to decode

    def __init__(self, voicechat: "VoiceChat", options: TranscriptionOptions):
        self.model = voicechat.model
        self.compute = ListeningState(voicechat.new_perception_stream(options.use_perception_cache),
                                      voicechat.new_rnnt_state())
        self.frame_index = 0

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
        rnnt = self.compute.rnnt
        delta = rnnt.commit(out.symbols)
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

    text_only = True

    def __init__(self, voicechat: "VoiceChat", options: TranscriptionOptions):
        super().__init__(TranscriptCore(voicechat, options), options, voicechat.config)

    @property
    def state(self) -> list[mx.array]:
        """The carried arrays: the streaming encoder's caches and the RNNT carry."""
        return self.core.compute.state
