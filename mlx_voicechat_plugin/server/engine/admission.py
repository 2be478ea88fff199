"""Who may open a realtime session now: the server's one admission rule, over the pool's ledger.

A connection holds a slot from the moment it is accepted until it ends
(:meth:`Admission.try_reserve` / :meth:`Admission.release`, on every exit
path), so a refusal comes at once, as ``server_busy`` / close 1013. A slot
is refused while the replica drains (:mod:`.drain`), beyond
``--max-sessions``, or when the state committed would pass
``--max-state-bytes``. Slots and reservations are kept in one record, the
:class:`~..runtime.ledger.ReservationLedger` the session pool writes the
open sessions' reservations into (their worst-case state,
:mod:`~..runtime.reservation`, never their current, growing size); a slot
whose session has not reserved yet counts the least a session reserves.
The pool checks a session's own reservation again when it opens, with its
real options (:class:`~..runtime.pool.PoolFull`).

The same figures say how many more sessions would be admitted
(:meth:`Admission.free_slots`), which the balancer's agent and ``/health``
report (:mod:`.replica`). Read from any thread.
"""

from __future__ import annotations

from typing import Any

from ...runtime.ledger import ReservationLedger
from ...runtime.pool import admission_error

# Why a session is refused while the replica drains (:mod:`.drain`).
DRAINING = "the server is shutting down; connect again to reach another replica"


class Admission:
    """Realtime session slots under ``max_sessions`` and ``max_state_bytes``, held in
    ``ledger`` (the one the engine's session pool is given); ``refused`` counts the
    refusals."""

    def __init__(self, max_sessions: int, max_state_bytes: int | None,
                 ledger: ReservationLedger, refused: Any):
        self.max_sessions = max_sessions
        self.max_state_bytes = max_state_bytes
        self.ledger = ledger
        self._refused = refused
        self.refusal = ""  # why the last reservation was refused
        self.draining = False  # set by the replica's drain: admit no one

    def try_reserve(self, session_id: str) -> bool:
        """Hold a slot for ``session_id``; ``False`` (see :attr:`refusal`) when none is left."""
        ledger = self.ledger
        with ledger.lock:
            reason = DRAINING if self.draining else admission_error(
                len(ledger.slots), self.max_sessions, ledger.committed_bytes(),
                self.max_state_bytes, ledger.least)
            if reason is not None:
                self.refusal = reason
                self._refused.inc()
                return False
            ledger.slots.add(session_id)
            return True

    def release(self, session_id: str) -> None:
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

    def free_slots(self) -> int:
        """Sessions :meth:`try_reserve` would admit now, by the same rule (draining aside)."""
        free = self.max_sessions - self.sessions_in_use
        if self.max_state_bytes is not None:
            room = self.max_state_bytes - self.ledger.committed_bytes()
            least = self.ledger.least
            free = min(free, room // least) if least > 0 else (free if room > 0 else 0)
        return max(free, 0)
