"""A session's numbered events and the recent ones kept for a resume's replay (event loop).

Every message a resumable session sends is stamped with ``seq`` (1-based,
gap-free, per session, across transports: :meth:`ReplayLog.stamp`) and kept
here while it may still be unacknowledged: a client that drops its
connection and resumes with the last ``seq`` it read is sent every event
after it (:meth:`ReplayLog.after`), in order. The log is bounded: at most
``max_frames`` frames' events (``--max-replay-seconds``), and a cap on their
count for events that come with no frame (pongs, errors). Past the bound the
oldest events go; a client further behind than that cannot resume (``after``
returns ``None``), and a detached session whose own unread events would
have to go (:attr:`ReplayLog.overflowed`) is ended.

A session that is not resumable keeps nothing while attached, only what it
makes while detached (the hook a test may use), with the same bounds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import NamedTuple

from .messages import PLAYBACK, AudioOut, JsonOut, Outgoing
from .wire import new_id

# Events kept per frame of the bound (a frame makes a handful), plus this many more.
EVENTS_PER_FRAME = 8
SPARE_EVENTS = 256


def with_seq(message: Outgoing, seq: int) -> Outgoing:
    """``message`` with ``"seq": seq`` and its ``event_id`` in its event, so a replay sends
    it as it was first sent (a copy; the original is left as it is)."""
    event = message.event if isinstance(message, AudioOut) else message.payload
    stamped = {"event_id": event.get("event_id") or new_id("event"), **event, "seq": seq}
    if isinstance(message, AudioOut):
        return replace(message, event=stamped)
    return JsonOut(stamped)


class Kept(NamedTuple):
    seq: int
    frame: int  # the session's frames run when it was made
    message: Outgoing


class ReplayLog:
    """One session's event numbers and its recent events."""

    def __init__(self, max_frames: float, numbered: bool = False):
        self.max_frames = max(int(max_frames), 1)
        self.max_events = self.max_frames * EVENTS_PER_FRAME + SPARE_EVENTS
        self.numbered = numbered  # stamp ``seq`` and keep events while attached (resumable)
        self.seq = 0  # the last number given
        self.kept: deque[Kept] = deque()
        self.detached_after: int | None = None  # the last seq sent before the transport went
        self.overflowed = False  # a detached session's unread events passed the bound

    def stamp(self, message: Outgoing, frame: int, attached: bool) -> Outgoing:
        """Number ``message`` (when numbered) and keep it if it may be asked for again;
        a message about the transport's own playback is neither."""
        if isinstance(message, PLAYBACK):
            return message
        self.seq += 1
        if self.numbered:
            message = with_seq(message, self.seq)
        if self.numbered or not attached:
            self.kept.append(Kept(self.seq, frame, message))
        self._trim(frame)
        return message

    def _trim(self, frame: int) -> None:
        kept = self.kept
        while kept and (frame - kept[0].frame > self.max_frames
                        or len(kept) > self.max_events):
            gone = kept.popleft()
            if self.detached_after is not None and gone.seq > self.detached_after:
                self.overflowed = True

    def detach(self) -> None:
        """The transport is gone: what follows is unread for sure."""
        self.detached_after = self.seq

    def held(self, last_seq: int) -> bool:
        """Whether every event after ``last_seq`` is still kept."""
        first = self.kept[0].seq if self.kept else self.seq + 1
        return 0 <= last_seq <= self.seq and last_seq + 1 >= first

    def after(self, last_seq: int | None) -> list[Outgoing] | None:
        """The events after ``last_seq`` (``None``: after the detach), in order; ``None`` if
        some of them are no longer kept. A session not numbered forgets what it returns."""
        if last_seq is None:
            last_seq = self.detached_after if self.detached_after is not None else self.seq
        if not self.held(last_seq):
            return None
        out = [k.message for k in self.kept if k.seq > last_seq]
        self.detached_after = None
        if not self.numbered:
            self.kept.clear()
        return out

    def clear(self) -> None:
        self.kept.clear()
