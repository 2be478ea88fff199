"""What passes between the layers of a realtime connection, typed, in no wire format.

The dialects (:mod:`.dialects`) make these; the transports
(:mod:`.transport`) carry them; the session (:mod:`.session`) and the
connection (:mod:`.connection`) pass them on. None of them is JSON text:

- :class:`JsonOut` is one control event, the dialect's object (a dict);
  :class:`JsonText` is one already written out (as the replay log keeps it);
- :class:`AudioOut` is audio for the client with the event that carries it in
  the dialect's own wire (its :attr:`~AudioOut.field` holds the audio there).
  A WebSocket transport writes the audio into that field (base64); a media
  transport could send the bytes on its own track instead;
- :class:`ClearAudio` and :class:`AudioMark` are about audio already sent, for a
  transport that plays it itself (a WebRTC track, paced in real time): drop
  what is queued unplayed (a barge-in), and say when playback reaches a point
  (the transport hands the mark back through ``receive()``); a transport
  whose client plays the audio (a WebSocket) ignores both;
- :class:`AudioIn` is client audio that came on a media track (WebRTC), not
  inside a protocol message: the connection hands it to the dialect
  (``Dialect.audio_in``), which takes it as it takes its own audio messages;
- :class:`Ending` says *why* a connection ends; each transport maps it to
  its own close (a WebSocket close code);
- :class:`Hangup` is the client's end of a transport, :class:`Finished` a
  dialect's (or the connection's) end of the conversation and
  :class:`ClientNotReading` a client that left its events unread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Union

NOT_READING = "client is not reading"


@dataclass(frozen=True)
class JsonOut:
    """One control event for the client: the dialect's object, as it goes out."""

    payload: dict[str, Any]


@dataclass(frozen=True)
class JsonText:
    """One control event already serialized, as sent (its bytes, not its parsed tree)."""

    text: str


@dataclass(frozen=True)
class AudioOut:
    """Audio for the client and the event that carries it in the dialect's wire.

    ``event`` has the key ``field`` already (its value ``None``), so the
    transport fills it where the dialect placed it. ``data`` is the audio in
    the client's encoding (``encoding``: ``"pcm16"`` little-endian, or a G.711
    type) at ``sample_rate``.
    """

    event: dict[str, Any]
    field: str
    data: bytes
    encoding: str
    sample_rate: int


@dataclass(frozen=True)
class AudioIn:
    """Client audio from a media track: PCM16 little-endian mono at ``sample_rate``."""

    data: bytes
    sample_rate: int


@dataclass(frozen=True)
class ClearAudio:
    """Drop the model's audio the transport holds unplayed (not numbered, not replayed)."""


@dataclass(frozen=True)
class AudioMark:
    """A point in the audio sent so far, named ``name``: a transport that plays the audio
    hands it back from ``receive()`` once everything before it has played (never when
    that audio was cleared); any other transport ignores it."""

    name: str


PLAYBACK = (ClearAudio, AudioMark)  # messages about a transport's own playback
Outgoing = Union[JsonOut, JsonText, AudioOut, ClearAudio, AudioMark]


class Ending(enum.Enum):
    """Why a connection ends; the transport chooses how it says so (e.g. a close code)."""

    DONE = "done"  # the conversation is over (the client committed, cancelled, the stream filled)
    BUSY = "busy"  # not admitted (no model, no room): try again later
    VIOLATION = "violation"  # a timeout, too many failed updates: the client broke a rule
    NOT_READING = "not reading"  # the client left its events unread
    STOPPING = "stopping"  # the server is stopping (a drain's end)
    SUPERSEDED = "superseded"  # a resume took the session to another connection


class Finished(Exception):
    """Ends the conversation (raised by a dialect, or a session's halt): close for ``ending``."""

    def __init__(self, ending: Ending = Ending.DONE):
        super().__init__(ending)
        self.ending = ending


class Hangup(Exception):
    """The client ended the transport (its close ``code``, where the transport has one)."""

    def __init__(self, code: int | None = None):
        super().__init__(code)
        self.code = code


class ClientNotReading(Exception):
    """The client left ``max_pending`` events, or ``max_pending_bytes``, unread (or stopped
    accepting them)."""
