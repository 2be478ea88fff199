"""The one streaming shell: PCM chunks of any size in, frames through a core, events out.

:class:`StreamingShell` owns what every realtime stream does the same way: it
bounds the stream's length and its transcript
(:class:`~.options.StreamLimits`), zero-pads the partial frame at ``flush``,
ends with ``Done`` or ``Cancelled`` and releases the state on every exit
path. A stream of its own also cuts the PCM ``push_audio`` is given into
1280-sample frames (keeping the partial one, its buffered samples bounded)
with a :class:`~.framing.Framer`; a stream framed by its caller (a
:class:`~.pool.StreamPool`'s: the server's session channel holds the framer)
has none and is handed whole frames, so every stream has exactly one framer.
A frame is computed by its core, one of:

- :class:`~.conversation.Conversation`: the full duplex conversation (every
  network advances one frame from persistent state,
  :class:`~.compute.ConversationState`; the per-frame compute and books are the
  ones offline generation runs): :class:`ConversationStream`;
- :class:`~.transcribe.TranscriptCore`: perception and the RNNT only, the user
  transcript: :class:`~.transcribe.TranscriptionStream`.

:func:`step_cores` runs one frame of many cores of one model as one batched
frame (:func:`~.compute.advance_batch`): every core's hearing half together,
the speaking half for the conversations. A stream is driven from one thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import numpy as np

from .audio import as_pcm_chunk
from .conversation import Conversation
from .events import Cancelled, Done, Event
from .framing import Chunk, Framer
from .compute import Batch, advance_batch
from .options import ConversationOptions, StreamLimits
from .profile import Profile

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .voicechat import VoiceChat


class ContextLimit(RuntimeError):
    """The stream reached ``max_streaming_seconds``.

    ``events``: those of the frames the same ``push_audio`` call ran before the
    limit (nothing is lost); the session stays open for ``flush``/``cancel``.
    """

    def __init__(self, message: str, events: list | None = None):
        super().__init__(message)
        self.events: list = [] if events is None else events


class TranscriptLimit(ContextLimit):
    """The stream's transcript reached ``max_transcript_bytes``; flush or cancel it."""


class StreamClosed(RuntimeError):
    """The stream has ended (flushed, cancelled or failed)."""


class Core(Protocol):
    """What the shell runs a frame through (see the module docstring)."""

    model: Any
    compute: Any  # the carried state: a ConversationState, or a transcript-only one
    frame_index: int
    decode_tokens: Callable[[Any], None] | None  # host text work of a speaking frame

    @property
    def transcript(self) -> str: ...

    def start_steps(self) -> Iterator[int]: ...

    def next_forced(self) -> int | None: ...

    def frame(self, frame: np.ndarray) -> list[Event]: ...

    def finish_frame(self, out: Any) -> list[Event]: ...

    def end(self) -> list[Event]: ...

    def finish_audio(self) -> list[Event]: ...

    def close(self) -> None: ...


class StreamingShell:
    """A core fed PCM as it arrives: chunks of any size in, each frame's events out."""

    def __init__(self, core: Core, options: StreamLimits, config: "ModelConfig",
                 framed_by_caller: bool = False):
        """``framed_by_caller``: the caller cuts the frames and hands them over (a pool's
        stream), so the stream holds no framer and ``push_audio`` is refused."""
        self.core = core
        self.options = options
        self.frame_samples = config.frame_samples
        self.sample_rate = config.input_sample_rate
        self.max_frames = options.max_frames(config.frame_duration)
        # What push_audio is given, framed; None where the caller frames.
        self.framer: Framer | None = None if framed_by_caller else Framer(self.frame_samples)
        self.closed = False

    @property
    def frame_index(self) -> int:
        return self.core.frame_index

    @property
    def transcript(self) -> str:
        return self.core.transcript

    @property
    def nbytes(self) -> int:
        """Bytes of the stream's state arrays (caches, carries, its own buffered PCM)."""
        return self.core.compute.nbytes + (0 if self.framer is None else self.framer.nbytes)

    def start_steps(self) -> Iterator[int]:
        """A deferred start (a conversation's system-prompt prefill), one position per
        step (yields the positions left); run it to the end before the first frame."""
        return self.core.start_steps()

    # --- limits ----------------------------------------------------------

    def limit_reached(self) -> ContextLimit | None:
        """The limit the next frame would pass, or ``None``."""
        if self.max_frames is not None and self.frame_index >= self.max_frames:
            return ContextLimit(
                f"stream reached max_streaming_seconds={self.options.max_streaming_seconds:g} "
                f"({self.max_frames} frames)"
            )
        limit = self.options.max_transcript_bytes
        if limit is not None and len(self.transcript.encode("utf-8")) >= limit:
            return TranscriptLimit(f"transcript reached max_transcript_bytes={limit}")
        return None

    def check_frame(self) -> None:
        """Whether a frame may run now: :class:`StreamClosed` once the stream has ended,
        :class:`ContextLimit` once the frame would pass a limit."""
        self._check_open()
        reached = self.limit_reached()
        if reached is not None:
            raise reached

    # --- framing ---------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise StreamClosed("the stream has ended (flushed, cancelled or failed); audio "
                                "after the end of input is rejected")

    def take_frames(self, samples: Any, sample_rate: int | None = None) -> list[np.ndarray]:
        """Buffer a PCM chunk; return the complete frames it makes, to run in order.

        Bad input (rate, dtype, shape, non-finite samples, too much buffered)
        raises before anything is buffered, and the stream stays usable.
        """
        self._check_open()
        if self.framer is None:
            raise RuntimeError("this stream is handed whole frames by its caller (a pool's "
                               "session: StreamPool.step); push_audio is for a stream of its "
                               "own (VoiceChat.create_streaming_session)")
        rate = self.sample_rate if sample_rate is None else sample_rate
        if rate != self.sample_rate:
            raise ValueError(f"sample_rate must be {self.sample_rate} Hz, got {rate}")
        chunk = as_pcm_chunk(samples)
        limit, buffered = self.options.max_buffered_samples, self.framer.buffered
        if limit is not None and buffered + chunk.shape[0] > limit:
            raise ValueError(
                f"audio chunk of {chunk.shape[0]} samples (with {buffered} "
                f"buffered) exceeds max_buffered_samples={limit}"
            )
        self.framer.add_chunk(Chunk(chunk.copy()))  # held past this call: not the caller's buffer
        return self.framer.take_frames()

    def drop_pending(self) -> None:
        """Forget buffered PCM (after :class:`ContextLimit`)."""
        if self.framer is not None:
            self.framer.clear()

    # --- the API ---------------------------------------------------------

    def push_audio(self, samples: Any, sample_rate: int | None = None) -> list[Event]:
        """Consume a mono float PCM chunk of any size; return the completed frames' events.

        Bad input raises before anything is consumed, and the stream stays
        usable. At a limit, :class:`ContextLimit` carries the events of the
        frames this call ran before it.
        """
        events: list[Event] = []
        for frame in self.take_frames(samples, sample_rate):
            try:
                self.check_frame()
                events.extend(self.core.frame(frame))
            except ContextLimit as exc:
                self.drop_pending()
                exc.events = events
                raise
        return events

    def flush(self, pad_partial: bool = True, partial: np.ndarray | None = None) -> list[Event]:
        """End the input: optionally zero-pad and run the partial frame, then the core's
        closing events and ``Done``; the stream is closed afterwards. The partial frame
        is the stream's own framer's, or ``partial`` from a caller that framed the audio
        itself (as the server's channels do; none: no partial frame)."""
        self._check_open()
        if self.framer is None:
            partial = np.zeros((0,), np.float32) if partial is None else partial
        elif partial is None:
            partial = self.framer.take_partial()
        elif self.framer.buffered:
            raise ValueError("flush(partial=...) is for a caller that framed its audio "
                             "itself; this stream holds audio from push_audio")
        events: list[Event] = []
        try:
            # At a limit the partial frame is dropped: the stream still ends
            # normally (the core's closing events, then Done).
            if partial.shape[0] and pad_partial and self.limit_reached() is None:
                frame = np.zeros((self.frame_samples,), dtype=np.float32)
                frame[: partial.shape[0]] = partial
                events.extend(self.core.frame(frame))
            events.extend(self.core.end())
        finally:
            self._close()
        events.append(Done(self.frame_index))
        return events

    def cancel(self) -> list[Event]:
        """Drop pending audio and end with what the last frame still owes, then ``Cancelled``."""
        if self.closed:
            return []
        try:
            events = self.core.finish_audio()
        finally:
            self._close()
        return [*events, Cancelled(self.frame_index)]

    def _close(self) -> None:
        """Release every state array (the books stay readable)."""
        if not self.closed:
            self.closed = True
            self.drop_pending()
            self.core.close()


class ConversationStream(StreamingShell):
    """One full conversation fed PCM as it arrives (the shell over a
    :class:`~.conversation.Conversation`): every frame goes through the
    streaming encoder and the same conversation an offline turn runs."""

    def __init__(self, parent: "VoiceChat", options: ConversationOptions, defer_start: bool = False,
                 framed_by_caller: bool = False):
        perception = parent.new_perception_stream(options.use_perception_cache)
        conversation = Conversation(parent, options, perception, defer_start)
        super().__init__(conversation, options, parent.config, framed_by_caller)

    @property
    def conversation(self) -> Conversation:
        return self.core

    @property
    def prompt_cache_hit(self) -> bool:
        return self.conversation.prompt_cache_hit

    def submit_tool_result(self, call_id: str, output: str) -> int:
        """Feed a call's result back: its tokens enter the next frames' function input.

        Returns the number of tokens queued. Raises :class:`ToolError` when no
        tools are registered, for an unknown or already answered ``call_id``,
        and for non-ASCII output.
        """
        self._check_open()
        return self.conversation.submit_tool_result(call_id, output)

    def profile(self) -> Profile:
        return self.conversation.profile

    @property
    def text(self) -> str:
        return self.conversation.text.text

    @property
    def function_text(self) -> str:
        return self.conversation.function.text


def step_cores(cores: list[Core], inputs: list[np.ndarray],
               batch: Batch | None = None) -> list[list[Event] | Exception]:
    """One frame of many cores of one model: one batched compute, then each one's books.

    Every core's hearing half (perception, RNNT) runs in one batch, the
    speaking half for the conversations among them. Each core gets its events,
    or the exception its own bookkeeping raised (the others' frames are
    unaffected); each equals that core's ``frame`` run alone. Not profiled.
    ``batch``: the caller's (a pool's), holding the cores' rows already
    (:meth:`~.compute.Batch.update`).
    """
    outs = advance_batch(cores[0].model, [c.compute for c in cores], inputs,
                         [c.next_forced() for c in cores],
                         on_tokens=[c.decode_tokens for c in cores], batch=batch)
    results: list[list[Event] | Exception] = []
    for core, out in zip(cores, outs):
        try:
            results.append(core.finish_frame(out))
        except Exception as exc:  # this core only
            results.append(exc)
    return results
