"""Who may open a realtime session now: the ledger's one admission rule, at a connection's accept.

A connection holds a slot from the moment it is accepted until it ends
(:meth:`Admission.accept` / :meth:`Admission.free`, on every exit
path), so a refusal comes at once, as ``server_busy`` / close 1013. A slot
is refused while the replica drains (:mod:`.drain`), beyond
``--max-sessions``, or when the state committed would pass
``--max-state-bytes``: :meth:`~..runtime.ledger.ReservationLedger.refusal`.
Slots, reservations and the bounds are kept in one record, the
:class:`~..runtime.ledger.ReservationLedger` the session pool writes the
open sessions' reservations into (their worst-case state,
:mod:`~..runtime.reservation`, never their current, growing size); a slot
whose session has not reserved yet counts the least a session reserves.
The pool asks the same rule again when a session opens, with its real
options (:class:`~..runtime.pool.PoolFull`).

A session detached from its transport (awaiting a resume, :mod:`..session.resume`)
keeps its slot only while no one else needs it: a reservation that finds
the server full (made with ``reclaim``: for a session that is real, one
configured or sending audio, never for a connection that has only opened)
asks the :class:`Reclaimer` (the replica's resumable sessions) to end one,
and takes its slot and its state bytes (a session that lets its slot go
has queued its close, which the engine runs before the newcomer's open: its
reservation no longer counts, :meth:`~..runtime.ledger.ReservationLedger.committed_bytes`). So
detached sessions count as free in :meth:`Admission.free_slots`.

The same figures say how many more sessions would be admitted
(:meth:`Admission.free_slots`), which the balancer's agent and ``/health``
report (:mod:`.replica`). Read from any thread; a reservation that reclaims
a slot runs on the event loop.
"""

from __future__ import annotations

import asyncio
from enum import Enum
from typing import Any, Protocol

from ...runtime.ledger import ReservationLedger

# Loop passes a connection that finds the server full waits for a session whose client
# has just left to let its slot go (:meth:`Admission.reserve`): a close or reset reaches
# that session's connection through its transport's reader in a few passes.
SETTLE_PASSES = 16
# Why a session is refused while the replica drains (:mod:`.drain`).
DRAINING = "the server is shutting down; connect again to reach another replica"


class Slot(Enum):
    """What :meth:`Admission.accept` gave a connection just accepted."""

    HELD = "held"  # a slot of its own
    DEFERRED = "deferred"  # a detached session's, taken when it opens (:meth:`Admission.reserve`)
    REFUSED = "refused"  # none (:attr:`Admission.refusal`, counted)


class Reclaimer(Protocol):
    """Who may give up a held slot for a newcomer (the detached sessions: :mod:`..session.resume`)."""

    def reclaim(self) -> bool:
        """End the longest-detached session, its slot free at once; ``False`` if none."""

    def reclaimable(self) -> list[str]:
        """The ids of the sessions :meth:`reclaim` could end now."""


class Admission:
    """Realtime session slots held in ``ledger`` (the one the engine's session pool is
    given), within its bounds; ``refused`` counts the refusals."""

    def __init__(self, ledger: ReservationLedger, refused: Any):
        self.ledger = ledger
        self._refused = refused
        self.refusal = ""  # why the last reservation was refused
        self.draining = False  # set by the replica's drain: admit no one
        self.reclaimer: Reclaimer | None = None  # set once by the app (:meth:`reclaim_from`)

    def reclaim_from(self, reclaimer: Reclaimer) -> None:
        """Let a reservation that finds the server full take a slot ``reclaimer`` gives up."""
        self.reclaimer = reclaimer

    async def accept(self, session_id: str) -> Slot:
        """The slot of a connection just accepted: a free one is held; a detached
        session's goes to a real session only, so when only those are left the slot is
        deferred to the session's open (configured, sending audio, a call answered),
        where :meth:`reserve` takes it; refused (counted) when none is left."""
        if await self.reserve(session_id, reclaim=False, count=False):
            return Slot.HELD
        if self.reclaimable > 0 and not self.draining:
            return Slot.DEFERRED
        return Slot.HELD if self.try_reserve(session_id) else Slot.REFUSED

    async def reserve(self, session_id: str, reclaim: bool = True, count: bool = True) -> bool:
        """:meth:`try_reserve` on the event loop, for a connection that finds the server
        full while a session's client has just left (a close or a reset the loop has
        received but not yet handed to that session's connection): the loop runs a few
        passes first, so the ending session's slot is free for the newcomer before any
        detached session is asked for its own."""
        for _ in range(SETTLE_PASSES):
            if self.try_reserve(session_id, count=False, reclaim=False):
                return True
            await asyncio.sleep(0)
        return self.try_reserve(session_id, count=count, reclaim=reclaim)

    def try_reserve(self, session_id: str, count: bool = True, reclaim: bool = True) -> bool:
        """Hold a slot for ``session_id``, taking a detached session's when the server is
        full (and ``reclaim``); ``False`` (see :attr:`refusal`; counted unless ``count``
        is false) when none is left."""
        ledger = self.ledger
        while True:
            with ledger.lock:
                reason = DRAINING if self.draining else ledger.refusal(
                    len(ledger.slots), ledger.committed_bytes())
                if reason is None:
                    ledger.slots.add(session_id)
                    return True
            # Outside the lock: the reclaimed session frees its slot through release().
            if self.draining or not reclaim or self.reclaimer is None \
                    or not self.reclaimer.reclaim():
                break
        self.refusal = reason
        if count:
            self._refused.inc()
        return False

    def free(self, session_id: str) -> None:
        """Free ``session_id``'s slot (its session ended, or let its slot go)."""
        with self.ledger.lock:
            self.ledger.slots.discard(session_id)

    @property
    def sessions_in_use(self) -> int:
        return len(self.ledger.slots)

    @property
    def state_bytes(self) -> int:
        """Measured bytes of the open sessions' state (updated by the engine thread)."""
        return self.ledger.state_bytes

    @property
    def reserved_bytes(self) -> int:
        """What the open sessions reserve: their worst-case state."""
        return self.ledger.reserved_bytes

    def reclaimable_sessions(self) -> list[str]:
        """The detached sessions, whose slots (and state bytes) a newcomer would take."""
        return self.reclaimer.reclaimable() if self.reclaimer is not None else []

    @property
    def reclaimable(self) -> int:
        """Slots held by detached sessions, which a newcomer would take."""
        return len(self.reclaimable_sessions())

    def free_slots(self) -> int:
        """Sessions :meth:`try_reserve` would admit now, by the same rule (draining aside):
        the detached sessions' slots and reservations count as free."""
        detached = self.reclaimable_sessions()
        ledger = self.ledger
        return ledger.admissible(self.sessions_in_use - len(detached),
                                 ledger.committed_bytes(free=set(detached)))
