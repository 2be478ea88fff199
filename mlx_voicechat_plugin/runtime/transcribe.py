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
- :class:`TranscriptionStream`: the text-only realtime session. Per 80 ms
  frame it runs the streaming mel frontend, the encoder step and the RNNT
  frame only, in the order the full :class:`StreamingSession` runs them, so its
  transcript equals a full session's on the same input. It emits runtime
  events (:class:`UserTranscriptDelta`, one :class:`TranscriptDone` at
  ``flush``, then :class:`Done`); the server's protocol layer serialises them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.nemotron_asr import tokenizer as sp_vocab

from ..models.perception import log_mel
from ..models.perception_stream import PerceptionStream
from ..models.rnnt import RNNTState
from .audio import AudioInput, as_pcm_chunk, load_waveform
from .events import Cancelled, Done, Event, UserTranscriptDelta
from .streaming import ContextLimit, SessionClosed

if TYPE_CHECKING:
    from .session import VoiceChatSession

logger = logging.getLogger(__name__)

RNNT_CHUNK_FRAMES = 25  # frames queued per evaluation (as ``models.rnnt.transcribe``)
DEFAULT_LANGUAGE = "en"  # the released checkpoint's language when config.json names none


def checkpoint_language(config: Any) -> str:
    """The language the checkpoint transcribes (``language`` in config.json, else English)."""
    language = getattr(config, "language", None)
    return language if isinstance(language, str) and language else DEFAULT_LANGUAGE


@dataclass(frozen=True)
class TranscriptDone:
    """The final user transcript of a text-only stream (exactly one, at ``flush``)."""

    frame_index: int
    text: str


@dataclass(frozen=True)
class Transcription:
    text: str
    tokens: list[int]
    duration: float  # the file's seconds
    frames: int  # encoder frames of the file (decoded unless ``truncated``)
    truncated: bool  # the output reached ``max_new_tokens``


class TranscriptLimit(ContextLimit):
    """The stream's transcript reached ``max_transcript_bytes``; flush or cancel it."""


def _positive_int(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


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

    def __init__(self, voicechat: "VoiceChatSession"):
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
        _positive_int("max_new_tokens", max_new_tokens)
        rate = self.sample_rate
        waveform = load_waveform(audio, rate, sample_rate)
        duration = waveform.shape[0] / rate
        mel = log_mel(waveform, self.config.audio_config)
        _, lengths, encoded = self.model.stt_model.perception(mel)
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

    def create_stream(self, options: "TranscriptionOptions | None" = None,
                      **kwargs: Any) -> "TranscriptionStream":
        if options is None:
            options = TranscriptionOptions(**kwargs)
        elif kwargs:
            raise TypeError("pass either TranscriptionOptions or keyword options, not both")
        return TranscriptionStream(self, options)


@dataclass
class TranscriptionOptions:
    max_streaming_seconds: float | None = None
    # UTF-8 bytes of transcript; a frame does not start once it is reached.
    max_transcript_bytes: int | None = None
    # Samples one push may leave waiting for a frame, with what is already buffered.
    max_buffered_samples: int | None = None
    use_perception_cache: bool = True

    def __post_init__(self) -> None:
        limit = self.max_streaming_seconds
        if limit is not None and (isinstance(limit, bool) or not limit > 0):
            raise ValueError(f"max_streaming_seconds must be > 0, got {limit!r}")
        _positive_int("max_transcript_bytes", self.max_transcript_bytes)
        _positive_int("max_buffered_samples", self.max_buffered_samples)


class TranscriptionStream:
    """A text-only realtime session: PCM in, the user transcript out.

    The same public surface as :class:`StreamingSession` where it applies
    (``push_audio``, ``flush``, ``cancel``, ``closed``, ``frame_index``,
    ``transcript``); driven from one thread.
    """

    text_only = True

    def __init__(self, transcriber: Transcriber, options: TranscriptionOptions):
        config = transcriber.config
        self.transcriber = transcriber
        self.config = config
        self.options = options
        self.frame_samples = config.frame_samples
        self.sample_rate = config.input_sample_rate
        self.max_frames = (
            None if options.max_streaming_seconds is None
            else int(options.max_streaming_seconds / config.frame_duration)
        )
        self._perception: PerceptionStream | None = PerceptionStream(
            transcriber.model.stt_model.perception, config, options.use_perception_cache
        )
        self._rnnt = transcriber.voicechat.new_rnnt_state()
        self._pending = np.zeros((0,), dtype=np.float32)
        self.frame_index = 0
        self.closed = False

    @property
    def transcript(self) -> str:
        return self._rnnt.text

    @property
    def state(self) -> list[mx.array]:
        """The carried arrays: the streaming encoder's caches and the RNNT carry."""
        return [] if self.closed else [*self._perception.state, *self._rnnt.state]

    @property
    def nbytes(self) -> int:
        """Measured bytes of :attr:`state` and the buffered PCM (what a session pool budgets)."""
        return sum(a.nbytes for a in self.state) + self._pending.nbytes

    def _check_limits(self) -> None:
        if self.max_frames is not None and self.frame_index >= self.max_frames:
            raise ContextLimit(
                f"stream reached max_streaming_seconds={self.options.max_streaming_seconds:g} "
                f"({self.max_frames} frames)"
            )
        limit = self.options.max_transcript_bytes
        if limit is not None and len(self.transcript.encode("utf-8")) >= limit:
            raise TranscriptLimit(f"transcript reached max_transcript_bytes={limit}")

    def _frame(self, frame: np.ndarray) -> list[Event]:
        """Perception and the RNNT for one frame, as the full session runs them."""
        self._check_limits()
        perception, rnnt = self._perception, self._rnnt
        _, encoded = perception.push(frame)
        first = rnnt.advance_first(encoded)
        listening = [] if first is None else [first, *rnnt.state]
        mx.eval(encoded, *perception.state, *listening)
        symbols = rnnt.advance_rest(first)
        if symbols is not None and symbols is not first:
            mx.eval(symbols, *rnnt.state)
        events: list[Event] = []
        delta = rnnt.commit(symbols)
        if delta is not None:
            events.append(UserTranscriptDelta(self.frame_index, delta, rnnt.text))
        self.frame_index += 1
        return events

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosed("transcription stream has ended; audio after the end of "
                                "input is rejected")

    def push_audio(self, samples: Any, sample_rate: int | None = None) -> list[Event]:
        """Consume a mono float PCM chunk; return the completed frames' transcript deltas.

        Bad input raises before anything is consumed; the stream stays usable.
        """
        self._check_open()
        rate = self.sample_rate if sample_rate is None else sample_rate
        if rate != self.sample_rate:
            raise ValueError(f"sample_rate must be {self.sample_rate} Hz, got {rate}")
        chunk = as_pcm_chunk(samples)
        limit = self.options.max_buffered_samples
        if limit is not None and self._pending.shape[0] + chunk.shape[0] > limit:
            raise ValueError(
                f"audio chunk of {chunk.shape[0]} samples (with {self._pending.shape[0]} "
                f"buffered) exceeds max_buffered_samples={limit}"
            )
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

    def flush(self, pad_partial: bool = True) -> list[Event]:
        """End of input: the zero-padded partial frame, one :class:`TranscriptDone`, ``Done``.

        Exactly one final transcript, also for an empty stream; the stream is
        closed afterwards and further audio raises :class:`SessionClosed`.
        """
        self._check_open()
        events: list[Event] = []
        try:
            if self._pending.shape[0] and pad_partial:
                frame = np.zeros((self.frame_samples,), dtype=np.float32)
                frame[: self._pending.shape[0]] = self._pending
                try:
                    events.extend(self._frame(frame))
                except ContextLimit:
                    pass  # at a limit the partial frame is dropped; the stream still ends
        finally:
            self._close()
        events.append(TranscriptDone(self.frame_index, self.transcript))
        events.append(Done(self.frame_index))
        return events

    def cancel(self) -> list[Event]:
        if self.closed:
            return []
        self._close()
        return [Cancelled(self.frame_index)]

    def _close(self) -> None:
        self.closed = True
        self._pending = np.zeros((0,), dtype=np.float32)
        self._rnnt.release()  # the transcript stays readable
        self._perception = None
