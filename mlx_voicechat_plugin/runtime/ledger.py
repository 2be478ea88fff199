"""The one record of session slots and reservations, and the one admission rule over them.

:class:`~.pool.StreamPool` writes the open sessions' reservations into it
(:mod:`.reservation`: each one's worst case, fixed when it opens) and their
measured state; a server's admission (:mod:`..server.engine.admission`)
holds a slot in it for each connection it accepts, before the connection's
session opens, and reads what is committed from it. Made before the pool
(a server admits while its model loads) and given to it. Read from any
thread; slots are taken under :attr:`ReservationLedger.lock`.

The ledger keeps the bounds too (``--max-sessions``, ``--max-state-bytes``,
fitted to memory at load) and decides admission in one place,
:meth:`ReservationLedger.refusal`: at load (can a session with the default
options be admitted at all), at a connection's accept (a slot) and at a
session's open (its reservation, once its options and prompt are known).
"""

from __future__ import annotations

import threading
from typing import Collection

from .options import check_positive_int


class ReservationLedger:
    """Session slots and reserved state bytes, by session id, within the session and
    state budgets."""

    def __init__(self, max_sessions: int = 1, max_state_bytes: int | None = None) -> None:
        self.bound(max_sessions, max_state_bytes)
        self.lock = threading.Lock()  # one admission decision at a time
        self.slots: set[str] = set()  # held from a connection's accept to its end
        self.reserved: dict[str, int] = {}  # open session -> its worst-case state bytes
        self.least = 0  # the least a new session reserves (the pool's; 0 before it exists)
        self.state_bytes = 0  # measured bytes of the open sessions' state

    def bound(self, max_sessions: int, max_state_bytes: int | None) -> None:
        """Set the budgets: ``max_sessions`` slots, ``max_state_bytes`` reserved in all
        (``None``: unbounded); a bad one raises naming it."""
        check_positive_int(max_sessions, "max_sessions")
        if max_state_bytes is not None:
            check_positive_int(max_state_bytes, "max_state_bytes")
        self.max_sessions = max_sessions
        self.max_state_bytes = max_state_bytes

    def refusal(self, in_use: int, committed: int, need: int | None = None) -> str | None:
        """The admission rule: why one more session would be refused, or ``None``.

        ``in_use``: the slots taken; ``committed``: the state bytes they reserve
        (their worst case, which their measured state never passes); ``need``: what
        the newcomer reserves (:data:`least` while its options are not known).
        """
        if in_use >= self.max_sessions:
            if self.max_sessions == 1:
                return "another realtime VoiceChat session is already active"
            return (f"all {self.max_sessions} realtime session slots are in use "
                    f"(--max-sessions {self.max_sessions})")
        need = self.least if need is None else need
        budget = self.max_state_bytes
        if budget is not None and (committed >= budget or committed + need > budget):
            return (f"sessions reserve {committed} bytes of state; one more needs {need} "
                    f"and the --max-state-bytes budget is {budget}")
        return None

    def admissible(self, in_use: int, committed: int) -> int:
        """How many more sessions :meth:`refusal` would admit one after another, each
        reserving :data:`least`."""
        more = 0
        while self.refusal(in_use + more, committed + more * self.least) is None:
            more += 1
        return more

    @property
    def reserved_bytes(self) -> int:
        """What the open sessions reserve in all."""
        return sum(list(self.reserved.values()))

    def committed_bytes(self, free: Collection[str] = ()) -> int:
        """What the slots held commit: each one's session's reservation, or the least a
        session reserves while it has not reserved yet. A reservation whose session holds
        no slot any more is not counted: its close is queued (a session lets its slot go
        after queueing its close) and runs before any later session opens, so its bytes
        are the newcomer's. ``free``: slots counted as free too (sessions a newcomer
        would end)."""
        reserved = dict(self.reserved)
        return sum(reserved.get(s, self.least) for s in list(self.slots) if s not in free)
