"""The one record of who holds a session slot and what state each open session reserves.

:class:`~.pool.StreamPool` writes the open sessions' reservations into it
(:mod:`.reservation`: each one's worst case, fixed when it opens) and their
measured state; a server's admission (:mod:`..server.engine.admission`)
holds a slot in it for each connection it accepts, before the connection's
session opens, and reads what is committed from it. Made before the pool
(a server admits while its model loads) and given to it. Read from any
thread; slots are taken under :attr:`ReservationLedger.lock`.
"""

from __future__ import annotations

import threading
from typing import Collection


class ReservationLedger:
    """Session slots and reserved state bytes, by session id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one admission decision at a time
        self.slots: set[str] = set()  # held from a connection's accept to its end
        self.reserved: dict[str, int] = {}  # open session -> its worst-case state bytes
        self.least = 0  # the least a new session reserves (the pool's; 0 before it exists)
        self.state_bytes = 0  # measured bytes of the open sessions' state

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
