"""Who may open a realtime session now: the server's one admission rule.

A connection holds a slot from the moment it is accepted until it ends
(:meth:`Admission.try_reserve` / :meth:`Admission.release`, on every exit
path), so a refusal comes at once, as ``server_busy`` / close 1013. A slot
is refused while the replica drains (:mod:`.drain`), beyond
``--max-sessions``, or when the sessions' reserved state would pass
``--max-state-bytes``: the open sessions' worst-case state
(:mod:`~..runtime.reservation`, never their current, growing size) plus the
least a session reserves for each connection admitted but not yet opened.
The pool checks a session's own reservation again when it opens, with its
real options (:class:`~..runtime.pool.PoolFull`).

The same figures say how many more sessions would be admitted
(:meth:`Admission.free_slots`), which the balancer's agent and ``/health``
report (:mod:`.replica`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ...runtime.pool import SessionPool, admission_error

# Why a session is refused while the replica drains (:mod:`.drain`).
DRAINING = "the server is shutting down; connect again to reach another replica"


class Admission:
    """Realtime session slots under ``max_sessions`` and ``max_state_bytes``.

    Read from any thread; ``pool`` gives the engine's session pool once the
    model is loaded (``None`` before), ``refused`` counts the refusals.
    """

    def __init__(self, max_sessions: int, max_state_bytes: int | None,
                 pool: Callable[[], SessionPool | None], refused: Any):
        self.max_sessions = max_sessions
        self.max_state_bytes = max_state_bytes
        self._pool = pool
        self._refused = refused
        self._lock = threading.Lock()
        self._reserved: set[str] = set()
        self.refusal = ""  # why the last reservation was refused
        self.draining = False  # set by the replica's drain: admit no one

    def try_reserve(self, session_id: str) -> bool:
        """Hold a slot for ``session_id``; ``False`` (see :attr:`refusal`) when none is left."""
        with self._lock:
            reason = DRAINING if self.draining else admission_error(
                len(self._reserved), self.max_sessions, self.committed_state_bytes,
                self.max_state_bytes, self.least_reservation)
            if reason is not None:
                self.refusal = reason
                self._refused.inc()
                return False
            self._reserved.add(session_id)
            return True

    def release(self, session_id: str) -> None:
        with self._lock:
            self._reserved.discard(session_id)

    @property
    def sessions_in_use(self) -> int:
        return len(self._reserved)

    @property
    def state_bytes(self) -> int:
        """Measured bytes of the open sessions' state (updated by the engine thread)."""
        pool = self._pool()
        return 0 if pool is None else pool.state_bytes

    @property
    def reserved_bytes(self) -> int:
        """What the open sessions reserve: their worst-case state."""
        pool = self._pool()
        return 0 if pool is None else pool.reserved_bytes

    @property
    def least_reservation(self) -> int:
        """The least state a new session reserves (0 before the model is loaded)."""
        pool = self._pool()
        return 0 if pool is None else pool.least_reservation()

    @property
    def committed_state_bytes(self) -> int:
        """What admission counts: the open sessions' reservations, and the least a session
        reserves for each connection admitted but not yet opened."""
        pool = self._pool()
        waiting = max(len(self._reserved) - (0 if pool is None else len(pool)), 0)
        return self.reserved_bytes + waiting * self.least_reservation

    def free_slots(self) -> int:
        """Sessions :meth:`try_reserve` would admit now, by the same rule (draining aside)."""
        free = self.max_sessions - self.sessions_in_use
        if self.max_state_bytes is not None:
            room = self.max_state_bytes - self.committed_state_bytes
            least = self.least_reservation
            free = min(free, room // least) if least > 0 else (free if room > 0 else 0)
        return max(free, 0)
