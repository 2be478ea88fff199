"""The engine's commands: one dataclass per kind, built on the event loop, run on the engine
thread, answered through a one-shot reply.

A socket task builds a command and queues it (:meth:`~.engine.Engine.submit`);
the engine thread runs it and resolves the command's asyncio future on the
task's loop (``loop.call_soon_threadsafe``). A command nobody awaits (an
:class:`Append`) has no future: its frames' events go to the session's sink.
Commands marked ``ordered`` are markers: they wait in their session's
channel behind the audio sent before them (:mod:`.channel`), and their reply
is resolved on the loop in its place among that session's events.

A session's events leave the engine as runtime events (:mod:`..runtime.events`),
never as JSON: the :class:`Open` command names the session's sink (its
:class:`~..session.session.Session`), which has its dialect translate them on its event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Union

import numpy as np

from ...runtime.options import ConversationOptions
from ...runtime.options import TranscriptionOptions

DeltaSink = Callable[[list], None]  # a file transcription's deltas (engine thread)
# What a session is opened with: a full conversation, or a text-only transcription.
OpenOptions = Union[ConversationOptions, TranscriptionOptions]


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
        """Answer from the engine thread (resolved on the caller's loop)."""
        if self.future is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.resolve, value, error)
        except RuntimeError:  # the loop has closed
            pass

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        """Answer on the caller's loop."""
        if self.future is None or self.future.done():  # the awaiting task was cancelled
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(value)


@dataclass
class Open(Command):
    """Open ``session_id`` (its prompt prefilled in slices); replies :class:`SessionDetails`."""

    session_id: str
    options: OpenOptions
    sink: Any  # a channel.Sink: its Session, translating the events on its loop


@dataclass
class Append(Command):
    """PCM at the session's input rate for its channel; a failing frame drops the rest
    of the chunks of ``tag``. ``sink`` hears of it if the session is not open;
    ``counted``: the client's audio (its feed's room), else the server's silence."""

    session_id: str
    samples: np.ndarray
    sink: Any
    tag: object
    counted: bool = True


@dataclass
class Sync(Command):
    """Replies once every frame queued before it has run and its events went out."""

    session_id: str
    ordered: ClassVar[bool] = True


@dataclass
class Flush(Command):
    """End the input (the partial frame handed over); replies the rest of the stream's events."""

    session_id: str
    pad_partial: bool = True
    ordered: ClassVar[bool] = True


@dataclass
class Cancel(Command):
    """End the stream now; replies its events (``Cancelled`` always among them)."""

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
    """Forget the session: its markers are answered with an error, its stream cancelled."""

    session_id: str


@dataclass
class Transcribe(Command):
    """A file's transcription as an engine job; replies its ``Transcription``."""

    audio: np.ndarray
    options: dict[str, Any]  # Transcriber.steps' keyword options
    on_delta: DeltaSink | None = None  # each step's UserTranscriptDelta list
    cancel: threading.Event = field(default_factory=threading.Event)


def take_commands(commands: "queue.Queue[Command | None]",
                  timeout: float | None) -> list[Command | None]:
    """The commands queued so far, waiting up to ``timeout`` for the first (``None``: no
    bound); the stop sentinel ``None`` ends the list (engine thread)."""
    try:
        if timeout == 0.0:
            first = commands.get_nowait()
        else:
            first = commands.get(timeout=timeout)
    except queue.Empty:
        return []
    taken = [first]
    while first is not None:
        try:
            taken.append(commands.get_nowait())
        except queue.Empty:
            break
        if taken[-1] is None:
            break
    return taken
