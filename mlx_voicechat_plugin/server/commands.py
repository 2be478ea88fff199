"""The engine's commands: one dataclass per kind, answered through a one-shot reply.

A socket task builds a command and queues it (:meth:`~.engine.Engine.submit`);
the engine thread runs it and resolves the command's asyncio future on the
task's loop (``loop.call_soon_threadsafe``). A command nobody awaits (an
:class:`Append`) has no future: its frames' events go to its feed.
Commands marked ``ordered`` wait in their session's input queue behind the
audio sent before them (:mod:`.scheduler`).

A session's events leave the engine as the JSON texts of its dialect: the
:class:`Open` command carries the dialect's :class:`Translator`, run on the
engine thread for every frame and command of that session.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Union

import numpy as np

from ..runtime.events import Event
from ..runtime.options import SessionOptions
from ..runtime.options import TranscriptionOptions

DeltaSink = Callable[[list], None]  # a file transcription's deltas (engine thread)
# What a session is opened with: a full conversation, or a text-only transcription.
OpenOptions = Union[SessionOptions, TranscriptionOptions]


class Translator:
    """What a dialect makes of one session's runtime events (called on the engine thread)."""

    def translate(self, events: list[Event]) -> list[str]:
        """One frame's (or command's) events as the texts sent, in order."""
        raise NotImplementedError

    def flushed(self, events: list[Event], first_frame: int) -> list[str]:
        """The events of the end of input (frames from ``first_frame`` on, then the end);
        by default translated as any others."""
        return self.translate(events)


@dataclass(frozen=True)
class SessionDetails:
    """What an opened session is: its rates, frame size and length bound."""

    input_sample_rate: int
    output_sample_rate: int
    frame_samples: int
    max_streaming_seconds: float | None
    text_only: bool


@dataclass(kw_only=True)
class Command:
    """One request to the engine thread; :meth:`reply` answers it on the caller's loop."""

    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    future: asyncio.Future | None = field(default=None, repr=False)  # None: nobody awaits
    ordered: ClassVar[bool] = False  # waits behind the audio queued before it

    def reply(self, value: Any = None, error: BaseException | None = None) -> None:
        if self.future is None:
            return

        def resolve() -> None:
            if self.future.done():  # the awaiting task was cancelled
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

        try:
            self.loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the loop has closed
            pass


@dataclass
class Open(Command):
    """Open ``session_id`` (its prompt prefilled in slices); replies :class:`SessionDetails`."""

    session_id: str
    options: OpenOptions
    translator: Translator


@dataclass
class Append(Command):
    """PCM at the session's input rate for its queue; its frames' events (or a frame's
    error) go to ``feed``; a failing frame drops the rest of the chunks of ``tag``."""

    session_id: str
    samples: np.ndarray
    feed: Any  # an InputFeed
    tag: object


@dataclass
class Push(Command):
    """PCM whose completed frames' events are the reply (its partial frame stays queued)."""

    session_id: str
    samples: np.ndarray


@dataclass
class Sync(Command):
    """Replies once every frame queued before it has run and its events went out."""

    session_id: str
    ordered: ClassVar[bool] = True


@dataclass
class Flush(Command):
    """End the input; replies the texts of the rest of the stream (:meth:`Translator.flushed`)."""

    session_id: str
    pad_partial: bool = True
    ordered: ClassVar[bool] = True


@dataclass
class Cancel(Command):
    """End the stream now; replies its texts (``Cancelled`` always among them)."""

    session_id: str
    ordered: ClassVar[bool] = True


@dataclass
class ToolResult(Command):
    """A tool call's output: its tokens enter the timeline at the next frames."""

    session_id: str
    call_id: str
    output: str
    ordered: ClassVar[bool] = True


@dataclass
class Close(Command):
    """Forget the session: its queue is answered with an error, its stream cancelled."""

    session_id: str


@dataclass
class Transcribe(Command):
    """A file's transcription as an engine job; replies its ``Transcription``."""

    audio: np.ndarray
    options: dict[str, Any]  # Transcriber.steps' keyword options
    on_delta: DeltaSink | None = None  # each step's UserTranscriptDelta list
    cancel: threading.Event = field(default_factory=threading.Event)
