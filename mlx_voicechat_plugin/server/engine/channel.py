"""One session's channel on the engine thread: its inbox, framed, and its hand-off.

The inbox is a :class:`~..runtime.framing.Framer`: PCM (:class:`Chunk`: the
client's audio, or the server's own silence) and markers (the engine
commands that must see the audio sent before them: commit, cancel, a tool
result, a barrier) in arrival order, cut into native frames there, so a
client's chunk sizes never change which samples make a frame. A marker runs
once no whole frame can be cut before it; the partial frame before it stays
in the inbox (the samples sent after the marker complete it), and a commit
takes it explicitly (:meth:`StreamChannel.take_partial`). The channel adds
when a frame became ready and when audio last arrived (the scheduler's
inputs).

What the engine did for the session in one cycle -- a frame's runtime
events, a frame's error, the replies of the markers it ran, the client
samples that left the inbox, how late its frames ran
(:class:`~.pace.FramePace`) -- is collected in one :class:`Handoff`, in order,
and handed to the session's sink on its event loop (its connection, which
translates the events into its dialect there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Union

import numpy as np

from ...runtime.framing import Chunk, Framer
from .pace import FramePace

__all__ = ["Chunk", "Entry", "FrameError", "FrameEvents", "Handoff", "Reply",
           "StreamChannel", "Sink", "hand_off"]


class Sink(Protocol):
    """Where a session's hand-offs go: ``on_handoff`` is called on ``event_loop``; each
    entry of one is applied to it (:meth:`Entry.apply`) in order."""

    event_loop: Any

    def on_handoff(self, handoff: "Handoff") -> None: ...

    def on_frame(self, events: list) -> None: ...  # a frame's runtime events

    def frame_error(self, error: BaseException) -> None: ...  # a frame failed


@dataclass
class FrameEvents:
    """One frame's runtime events."""

    events: list

    def apply(self, sink: Sink) -> None:
        sink.on_frame(self.events)


@dataclass
class FrameError:
    """A queued frame failed (the rest of its append is dropped)."""

    error: BaseException

    def apply(self, sink: Sink) -> None:
        sink.frame_error(self.error)


@dataclass
class Reply:
    """A marker's answer, resolved on the loop in its place among the events."""

    command: Any
    value: Any = None
    error: BaseException | None = None

    def resolve(self) -> None:
        self.command.resolve(self.value, self.error)

    def apply(self, sink: Sink) -> None:
        self.resolve()


Entry = Union[FrameEvents, FrameError, Reply]


@dataclass
class Handoff:
    """One cycle's output of a session, in order (:data:`Entry`: a frame's events, a
    frame's error, a marker's reply); the client samples consumed; and how late the
    frames stepped ran."""

    entries: list[Entry] = field(default_factory=list)
    consumed: int = 0
    pace: FramePace = field(default_factory=FramePace)


def hand_off(sink: Sink | None, handoff: Handoff) -> None:
    """``sink.on_handoff(handoff)`` on the sink's loop (nothing once that loop has closed)."""
    if sink is None:
        return
    try:
        sink.event_loop.call_soon_threadsafe(sink.on_handoff, handoff)
    except RuntimeError:  # the loop has closed
        pass


class StreamChannel:
    """One open session's inbox (engine thread only)."""

    def __init__(self, frame_samples: int, sink: Sink | None = None):
        self.sink = sink
        self.framer = Framer(frame_samples, self._consumed)
        self.ready_since: float | None = None  # when the head frame became complete
        self.last_arrival = float("-inf")
        self.out = Handoff()

    @property
    def items(self) -> Any:
        """Chunks and markers in arrival order."""
        return self.framer.items

    # --- filling ----------------------------------------------------------------

    def add_chunk(self, chunk: Chunk, now: float) -> None:
        self.last_arrival = now
        self.framer.add_chunk(chunk)
        self._mark(now)

    def add_marker(self, command: Any) -> None:
        self.framer.add_marker(command)

    @property
    def buffered(self) -> int:
        """Samples waiting in the inbox (all chunks, before and after markers)."""
        return self.framer.buffered

    @property
    def nbytes(self) -> int:
        return self.framer.nbytes

    # --- what is ready ------------------------------------------------------------

    def frame_ready(self) -> bool:
        return self.framer.frame_ready()

    def head_marker(self) -> Any:
        """The first marker once no frame can be cut before it, else ``None``."""
        return self.framer.head_marker()

    def _mark(self, now: float) -> None:
        if not self.frame_ready():
            self.ready_since = None
        elif self.ready_since is None:
            self.ready_since = now

    # --- taking -------------------------------------------------------------------

    def take_frame(self, now: float) -> tuple[np.ndarray, object]:
        """The next native frame and the tag of the append that completed it."""
        taken = self.framer.take_frame()
        self._mark(now)
        return taken

    def take_partial(self) -> np.ndarray:
        """The partial frame before the head marker, handed over (to a commit)."""
        return self.framer.take_partial()

    def pop_marker(self, now: float) -> Any:
        """Take the head marker out of the inbox; the partial frame before it stays."""
        marker = self.framer.pop_marker()
        self._mark(now)
        return marker

    def drop_tag(self, tag: object, now: float) -> None:
        """Forget the rest of one append (its frame failed)."""
        self.framer.drop_tag(tag)
        self._mark(now)

    def drain(self) -> Iterator[Any]:
        """Every marker left (the session is closing); the PCM is forgotten."""
        yield from self.framer.drain()
        self.ready_since = None

    def _consumed(self, samples: int) -> None:
        self.out.consumed += samples

    # --- out ----------------------------------------------------------------------

    def emit(self, entry: Entry) -> None:
        """A frame's events, a frame's error, or a marker's :class:`Reply`."""
        self.out.entries.append(entry)

    def paced(self, frames: int, seconds: float, frame_duration: float) -> None:
        """``frames`` of the session's frames ran in a step (or a flush) of ``seconds``."""
        self.out.pace.step(frames, seconds, frame_duration)

    def send(self) -> None:
        """Hand this cycle's output to the sink (if there is any)."""
        out = self.out
        if out.entries or out.consumed or out.pace.frames:
            self.out = Handoff()
            hand_off(self.sink, out)
