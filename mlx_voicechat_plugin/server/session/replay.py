"""A session's numbered events and the recent ones kept for a resume's replay (event loop).

Every message a resumable session sends is stamped with ``seq`` (1-based,
gap-free, per session, across transports: :meth:`ReplayLog.stamp`) and kept
here while it may still be unacknowledged: a client that drops its
connection and resumes with the last ``seq`` it read is sent every event
after it (:meth:`ReplayLog.after`), in order. Events are kept as the text
sent (:class:`~..messages.JsonText`, audio as its bytes), never as parsed
trees. The log is bounded: at most ``max_frames`` frames' events
(``--max-replay-seconds``), ``max_bytes`` of them (``--max-replay-bytes``:
a client's echoed items count at their size), and a cap on their count for
events that come with no frame (pongs, errors). Past the bound the
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

from ..messages import PLAYBACK, AudioOut, JsonText, Outgoing
from ..wire import dumps, new_id

# Events kept per frame of the bound (a frame makes a handful), plus this many more.
EVENTS_PER_FRAME = 8
SPARE_EVENTS = 256
# What an audio event costs besides its audio (base64 takes 4 bytes for 3).
AUDIO_EVENT_BYTES = 256


def with_seq(message: Outgoing, seq: int | None) -> Outgoing:
    """``message`` as kept: stamped with ``"seq": seq`` (unless ``None``) and its
    ``event_id``, so a replay sends it as it was first sent, a control event written
    out once (:class:`JsonText`); the original is left as it is."""
    if isinstance(message, JsonText):
        return message
    event = message.event if isinstance(message, AudioOut) else message.payload
    stamped = {"event_id": event.get("event_id") or new_id("event"), **event}
    if seq is not None:
        stamped["seq"] = seq
    if isinstance(message, AudioOut):
        return replace(message, event=stamped)
    return JsonText(dumps(stamped))


def kept_bytes(message: Outgoing) -> int:
    """About what ``message`` (as kept) holds: its text, or its audio as sent."""
    if isinstance(message, AudioOut):
        return AUDIO_EVENT_BYTES + len(message.data) * 4 // 3
    return len(message.text) if isinstance(message, JsonText) else AUDIO_EVENT_BYTES


class Kept(NamedTuple):
    seq: int
    frame: int  # the session's frames run when it was made
    message: Outgoing
    size: int  # :func:`kept_bytes`


class ReplayLog:
    """One session's event numbers and its recent events."""

    def __init__(self, max_frames: float, numbered: bool = False,
                 max_bytes: int | None = None):
        self.max_frames = max(int(max_frames), 1)
        self.max_events = self.max_frames * EVENTS_PER_FRAME + SPARE_EVENTS
        self.max_bytes = max_bytes  # what the kept events may hold (None: unbounded)
        self.bytes = 0  # what they hold
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
        if self.numbered or not attached:
            message = with_seq(message, self.seq if self.numbered else None)
            size = kept_bytes(message)
            self.kept.append(Kept(self.seq, frame, message, size))
            self.bytes += size
        self._trim(frame)
        return message

    def _trim(self, frame: int) -> None:
        kept = self.kept
        while kept and (frame - kept[0].frame > self.max_frames
                        or len(kept) > self.max_events
                        or (self.max_bytes is not None and self.bytes > self.max_bytes)):
            gone = kept.popleft()
            self.bytes -= gone.size
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
            self.clear()
        return out

    def clear(self) -> None:
        self.kept.clear()
        self.bytes = 0
