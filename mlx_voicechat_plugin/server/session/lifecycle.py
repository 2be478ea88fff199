"""A session's life as two explicit states, each moved only by its :class:`~.session.Session`.

The engine side (:class:`Stage`) says what the engine holds of the session;
the link side (:class:`Tie`) says whether a client's transport carries it
(docs/development.md, "A session's life", draws both)::

    engine side                              link side

    NEW --open_session--> OPENING --> OPEN    UNLINKED --attach--> ATTACHED
    NEW <--re-open-- OPENING, OPEN            ATTACHED --detach--> DETACHED
    OPENING, OPEN --let_go--> CLOSING         DETACHED --claim--> CLAIMED
    CLOSING, NEW --release--> CLOSED          CLAIMED --unclaim--> DETACHED
                                              DETACHED, CLAIMED --attach--> ATTACHED
                                              any --release--> RELEASED

``OPENING`` is also where a failed open stays (the engine may still hold
what it made: :meth:`~.session.Session.release` closes it). Each move is
one method of :class:`~.session.Session`; a move this table does not allow
is refused with :class:`TransitionRefused`, naming the session and both
states. Nothing else writes them.
"""

from __future__ import annotations

from enum import Enum


class Stage(Enum):
    """What the engine holds of a session."""

    NEW = "new"  # nothing asked of the engine yet (or closed, to be opened again)
    OPENING = "opening"  # its open (the prompt's prefill) is queued or running, or failed
    OPEN = "open"  # the engine holds its stream: the session is configured
    CLOSING = "closing"  # its close is queued; its slot is free
    CLOSED = "closed"  # released: nothing of it is left


class Tie(Enum):
    """Whether a client's transport carries a session."""

    UNLINKED = "unlinked"  # made, no transport yet
    ATTACHED = "attached"  # a transport carries its events
    DETACHED = "detached"  # its transport ended; it awaits a resume (its events kept)
    CLAIMED = "claimed"  # a resume is being accepted (another is refused)
    RELEASED = "released"  # ended: no transport will carry it again


ENGINE_MOVES: dict[Stage, frozenset[Stage]] = {
    Stage.NEW: frozenset({Stage.OPENING, Stage.CLOSED}),
    Stage.OPENING: frozenset({Stage.OPEN, Stage.NEW, Stage.CLOSING}),
    Stage.OPEN: frozenset({Stage.NEW, Stage.CLOSING}),
    Stage.CLOSING: frozenset({Stage.CLOSED}),
    Stage.CLOSED: frozenset(),
}
LINK_MOVES: dict[Tie, frozenset[Tie]] = {
    Tie.UNLINKED: frozenset({Tie.ATTACHED, Tie.RELEASED}),
    Tie.ATTACHED: frozenset({Tie.DETACHED, Tie.RELEASED}),
    Tie.DETACHED: frozenset({Tie.CLAIMED, Tie.ATTACHED, Tie.RELEASED}),
    Tie.CLAIMED: frozenset({Tie.ATTACHED, Tie.DETACHED, Tie.RELEASED}),
    Tie.RELEASED: frozenset(),
}


class TransitionRefused(RuntimeError):
    """A move the lifecycle does not allow (a bug in the caller, never a client's error)."""


class Lifecycle:
    """One session's two states (only its :class:`~.session.Session` moves them)."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.stage = Stage.NEW
        self.tie = Tie.UNLINKED

    def move_engine(self, to: Stage) -> None:
        if to not in ENGINE_MOVES[self.stage]:
            raise TransitionRefused(f"{self.session_id}: the engine side cannot go from "
                                    f"{self.stage.value} to {to.value}")
        self.stage = to

    def move_link(self, to: Tie) -> None:
        if to not in LINK_MOVES[self.tie]:
            raise TransitionRefused(f"{self.session_id}: the link side cannot go from "
                                    f"{self.tie.value} to {to.value}")
        self.tie = to
