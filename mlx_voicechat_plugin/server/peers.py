"""What a :class:`~.session.Session` talks to, by their shapes: the :class:`Link` its
messages go to (a connection, over its transport), the :class:`Watcher` that keeps track
of its transports (:mod:`.resume`) and its :class:`SessionDialect` (the dialects sit
above the session, so it names them by what it asks of them)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from .engine.pace import FramePace
from .messages import AudioIn, AudioMark, Outgoing
from .wire import ProtocolError

if TYPE_CHECKING:
    from .session import Session


class Link(Protocol):
    """Where an attached session's messages go (a connection, over its transport)."""

    def send(self, message: Outgoing) -> None:
        """Queue ``message`` for the client; :class:`ClientNotReading` if it cannot."""

    def replay(self, messages: list[Outgoing]) -> None:
        """Queue a resume's replay (the events the client missed), delivered as it reads:
        the slow-reader rule applies to what the session sends next, not to these."""

    async def watch(self, opening: asyncio.Future) -> None:
        """Wait for the engine to open the session while watching the transport."""

    def supersede(self) -> None: ...  # a resume took the session: stop reading, close


class Watcher(Protocol):
    """Who keeps track of a session's transports (the resume tokens, :mod:`.resume`)."""

    def detached(self, session: "Session") -> None: ...

    def resumed(self, session: "Session") -> None: ...

    def released(self, session: "Session") -> None: ...


class SessionDialect(Protocol):
    """What the session and its connection ask of its dialect, on the loop
    (:class:`~.dialects.base.Dialect`; the dialects sit above this module, so it names
    them by their shape)."""

    plays_audio: bool  # set from the transport: its own playback events are the dialect's

    def translate(self, events: list) -> list[Outgoing]:
        """One frame's (or a command's) runtime events as the messages sent, in order."""

    def frame_error(self, exc: BaseException) -> list[Outgoing]:
        """A queued frame failed: what the client is told."""

    def paced(self, pace: FramePace) -> None: ...  # how late the next hand-off's frames ran

    def greet(self) -> Outgoing | None: ...  # the first event (resume token and all), if any

    def error(self, code: str, message: str) -> Outgoing: ...

    def refused(self, error: ProtocolError) -> None: ...  # a message refused: may end it

    def timed_out(self, reason: str) -> Outgoing: ...

    def resumed(self, last_seq: int, replayed: int) -> Outgoing: ...

    def parse(self, message: str | bytes) -> Any: ...

    def audio_in(self, audio: AudioIn) -> Any: ...

    def played(self, mark: AudioMark) -> None: ...

    def queues_audio(self, message: Any) -> bool: ...

    async def dispatch(self, message: Any) -> None: ...
