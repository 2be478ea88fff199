"""Online voice chat: PCM chunks in, aligned text / transcript / audio events out.

Every network advances exactly one frame per 1280-sample frame from persistent
state (:class:`~.frame.ConversationState`: the streaming encoder, the
:class:`Timeline`, the RNNT carry and the codec stream). The per-frame compute
(:func:`~.frame.advance`) and books (:class:`~.conversation.Conversation`)
are the ones offline generation runs. A session is driven from one thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ..models.perception_stream import PerceptionStream
from .audio import as_pcm_chunk
from .conversation import Conversation
from .events import Cancelled, Done, Event
from .options import SessionOptions, StreamingOptions
from .profile import Profile
from .timeline import Timeline

# StreamingOptions: the options' earlier name, still importable from here.
__all__ = ["ContextLimit", "SessionClosed", "StreamingOptions", "StreamingSession"]

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


class StreamingSession:
    """One conversation fed PCM as it arrives: chunks of any size in, each frame's events out.

    PCM is cut into 1280-sample frames; each frame goes through the
    streaming encoder (:class:`PerceptionStream`) and the same
    :class:`~.conversation.Conversation` an offline turn runs.
    """

    def __init__(self, parent: "VoiceChatSession", options: SessionOptions,
                 defer_start: bool = False):
        config = parent.config
        self.parent = parent
        self.model = parent.model
        self.config = config
        self.options = options
        self.frame_samples = config.frame_samples
        self.sample_rate = config.input_sample_rate
        self.max_frames = (
            None
            if options.max_streaming_seconds is None
            else int(options.max_streaming_seconds / config.frame_duration)
        )
        perception = PerceptionStream(
            parent.model.stt_model.perception, config, options.use_perception_cache
        )
        self.conversation = Conversation(parent, options, perception, defer_start)
        self._pending = np.zeros((0,), dtype=np.float32)
        self.closed = False

    @property
    def prompt_cache_hit(self) -> bool:
        return self.conversation.prompt_cache_hit

    def start_steps(self) -> Iterator[int]:
        """With ``defer_start``: the system-prompt prefill, one position per step
        (yields the positions left); run it to the end before the first frame."""
        return self.conversation.start_steps()

    @property
    def frame_index(self) -> int:
        return self.conversation.frame_index

    @property
    def timeline(self) -> Timeline:
        return self.conversation.compute.timeline

    @property
    def perception(self) -> PerceptionStream:
        return self.conversation.compute.perception

    @property
    def tools(self):
        return self.conversation.tools

    @property
    def nbytes(self) -> int:
        """Bytes of the session's state arrays (caches, carries, buffered PCM)."""
        return self.conversation.compute.nbytes + self._pending.nbytes

    def _frame(self, frame: np.ndarray) -> list[Event]:
        self.check_limit()
        return self.conversation.frame(frame)

    def check_limit(self) -> None:
        """:class:`ContextLimit` once the stream has run ``max_streaming_seconds`` of frames."""
        if self._at_limit():
            raise ContextLimit(
                f"stream reached max_streaming_seconds={self.options.max_streaming_seconds:g} "
                f"({self.max_frames} frames)"
            )

    def take_frames(self, samples: Any, sample_rate: int | None = None) -> list[np.ndarray]:
        """Buffer a PCM chunk; return the complete frames it makes, to run in order.

        Bad input (rate, dtype, shape, non-finite samples) raises before
        anything is buffered, and the session stays usable.
        """
        self._check_open()
        rate = self.sample_rate if sample_rate is None else sample_rate
        if rate != self.sample_rate:
            raise ValueError(f"sample_rate must be {self.sample_rate} Hz, got {rate}")
        self._pending = np.concatenate([self._pending, as_pcm_chunk(samples)])
        count = self._pending.shape[0] // self.frame_samples
        frames = [self._pending[i * self.frame_samples : (i + 1) * self.frame_samples]
                  for i in range(count)]
        self._pending = self._pending[count * self.frame_samples :]
        return frames

    def drop_pending(self) -> None:
        """Forget buffered PCM (after :class:`ContextLimit`)."""
        self._pending = np.zeros((0,), dtype=np.float32)

    # --- the API --------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosed("streaming session is closed")

    def push_audio(self, samples: Any, sample_rate: int | None = None) -> list[Event]:
        """Consume a mono float PCM chunk of any size; return the completed frames' events.

        Bad input (rate, dtype, shape, non-finite samples) raises before anything
        is consumed, and the session stays usable.
        """
        events: list[Event] = []
        for frame in self.take_frames(samples, sample_rate):
            try:
                events.extend(self._frame(frame))
            except ContextLimit as exc:
                self.drop_pending()
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
            events.extend(self.conversation.end())
        finally:
            self._close()
        events.append(Done(self.frame_index))
        return events

    def cancel(self) -> list[Event]:
        """Drop pending audio and end with ``Cancelled``."""
        if self.closed:
            return []
        try:
            events = self.conversation.finish_audio()
        finally:
            self._close()
        return [*events, Cancelled(self.frame_index)]

    def submit_tool_result(self, call_id: str, output: str) -> int:
        """Feed a call's result back: its tokens enter the next frames' function input.

        Returns the number of tokens queued. Raises :class:`ToolError` when no
        tools are registered, for an unknown or already answered ``call_id``,
        and for non-ASCII output.
        """
        self._check_open()
        return self.conversation.submit_tool_result(call_id, output)

    def _close(self) -> None:
        """Release every state array (the books stay readable)."""
        if not self.closed:
            self.closed = True
            self._pending = np.zeros((0,), dtype=np.float32)
            self.conversation.close()

    def profile(self) -> Profile:
        return self.conversation.profile

    @property
    def transcript(self) -> str:
        return self.conversation.transcript

    @property
    def text(self) -> str:
        return self.conversation.text.text

    @property
    def function_text(self) -> str:
        return self.conversation.function.text
