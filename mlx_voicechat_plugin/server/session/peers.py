"""What a :class:`~.session.Session` talks to, by their shapes: the :class:`Link` its
messages go to (a connection, over its transport) and the :class:`Watcher` that keeps
track of its transports (:mod:`.resume`). Its dialect is a
:class:`~..dialects.base.Dialect`, named for the types only (the dialects sit above it)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from ..messages import Outgoing

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
