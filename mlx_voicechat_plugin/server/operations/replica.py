"""What one replica tells a balancer: ready or not, draining or not, and how many sessions it
holds (read from the live engine on the event loop).

One :class:`ReplicaStatus` is read from the live engine (:func:`replica_status`)
and said two ways: the line of HAProxy's agent-check (:func:`agent_line`,
served by :mod:`.agent` on ``--agent-port``) and ``GET /health``
(:func:`health_response`), whose status code a readiness probe uses (200:
send new sessions here; 503: loading or draining; 500: failed).

The capacity is the number of sessions the replica holds at most right now:
the sessions attached to a client plus the free slots
(:meth:`~.admission.Admission.free_slots`: ``--max-sessions``, and the
sessions whose reserved state still fits ``--max-state-bytes``). A session
detached from its client (awaiting a resume) counts as free: a newcomer
takes its slot, and it holds no balancer connection. HAProxy counts its
own connections to the server against ``maxconn``, so reporting the total
(not the free count) lets it fill each replica to exactly what it admits and
queue the rest, never sending a session to a full replica.

The agent-check line, as HAProxy 2.x parses it (``doc/configuration.txt``,
"agent-check", and ``tcpcheck_agent_expect_reply``): words separated by
blanks or commas, ending at the first ``\\r`` or ``\\n``; ``up`` / ``down`` set
the operational state, ``ready`` / ``drain`` the administrative one,
``maxconn:N`` the server's connection limit, and a ``#`` *at the start of a
word* begins a description (so ``down #loading``, never ``down#loading``,
which HAProxy would read as one unknown word). ``maxconn:0`` would mean *no
limit* to HAProxy, so it is never sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fastapi.responses import JSONResponse

MAX_REASON_CHARS = 120  # of a down reason on the agent line (HAProxy shows it in its stats)


@dataclass(frozen=True)
class ReplicaStatus:
    """One reading of a replica's state."""

    loaded: bool  # model loaded and warmed up (``--compile``): sessions can run
    draining: bool  # stopping: open sessions finish, no new ones (SIGTERM, server.drain)
    failure: str | None  # why it cannot serve at all: a load error, or the engine stopped
    sessions: int  # realtime sessions holding a slot now (detached ones included)
    free: int  # more sessions it would admit now (0 while full; detached slots count)
    detached: int = 0  # of ``sessions``, those awaiting a resume (a newcomer takes their slot)

    @property
    def ready(self) -> bool:
        """Whether new sessions should be sent here."""
        return self.loaded and not self.draining and self.failure is None

    @property
    def capacity(self) -> int:
        """The most sessions it holds right now: attached ones plus free slots."""
        return self.sessions - self.detached + self.free


def engine_failure(engine: Any) -> str | None:
    """Why the engine cannot serve: its load error, or its thread having stopped."""
    if engine.load_error is not None:
        return f"model failed to load: {engine.load_error}"
    if engine.ready and not engine.running:
        return "the engine thread stopped"
    return None


def replica_status(engine: Any, draining: bool = False) -> ReplicaStatus:
    """``engine``'s state now; nothing is free while it loads, drains or has failed."""
    failure = engine_failure(engine)
    admitting = engine.ready and not draining and failure is None
    admission = engine.admission
    return ReplicaStatus(loaded=engine.ready, draining=draining, failure=failure,
                         sessions=admission.sessions_in_use,
                         free=admission.free_slots() if admitting else 0,
                         detached=admission.reclaimable if admitting else 0)


def _reason(text: str) -> str:
    """One line of printable ASCII (HAProxy stops the line at ``\\r`` / ``\\n``)."""
    clean = "".join(c if c.isascii() and c.isprintable() else " " for c in text)
    return " ".join(clean.split())[:MAX_REASON_CHARS] or "unavailable"


def agent_line(status: ReplicaStatus) -> str:
    """The agent-check answer, newline included.

    ``down #<reason>`` before the model is loaded (and warm) or after a
    failure; ``drain`` while draining; else ``up ready maxconn:<capacity>``
    (``ready`` also undoes a ``drain`` an earlier process of this replica
    reported: HAProxy keeps an agent's admin state until the agent changes it).
    """
    if status.failure is not None:
        return f"down #{_reason(status.failure)}\n"
    if not status.loaded:
        return "down #loading the model\n"
    if status.draining:
        return "drain\n"
    return f"up ready maxconn:{max(status.capacity, 1)}\n"


def health_response(status: ReplicaStatus, model_id: str, engine: Any,
                    load_error: BaseException | None = None,
                    context_seconds: float | None = None) -> JSONResponse:
    """``GET /health``: 200 while new sessions may come, 503 loading or draining, 500 failed."""
    body: dict[str, Any] = {
        "ready": status.ready, "draining": status.draining,
        "sessions": status.sessions, "capacity": status.capacity, "free": status.free,
        "detached": status.detached,
        "max_sessions": engine.max_sessions,
    }
    if status.failure is not None:
        error = str(load_error) if load_error is not None else status.failure
        return JSONResponse({"status": "error", "error": error, **body}, 500)
    if not status.loaded:
        return JSONResponse({"status": "loading", **body}, 503)
    admission = engine.admission
    body.update({"model": model_id, "session_active": status.sessions > 0,
                 "state_bytes": admission.state_bytes, "max_state_bytes": engine.max_state_bytes,
                 "reserved_state_bytes": admission.reserved_bytes,
                 "context_seconds": context_seconds})
    if status.draining:
        return JSONResponse({"status": "draining", **body}, 503)
    return JSONResponse({"status": "ok", **body})


def add_replica_metrics(metrics: Any, status: Callable[[], ReplicaStatus]) -> None:
    """``/metrics`` gauges read from ``status()`` at each scrape: ready, draining, capacity."""
    from prometheus_client import Gauge

    r = metrics.registry
    Gauge("voicechat_replica_ready", "1 while new sessions may be sent here (/health 200)",
          registry=r).set_function(lambda: float(status().ready))
    Gauge("voicechat_replica_draining", "1 while the replica drains (stopping)",
          registry=r).set_function(lambda: float(status().draining))
    Gauge("voicechat_session_capacity", "Sessions the replica holds at most now: open plus "
          "free (the agent-check's maxconn)", registry=r).set_function(
        lambda: float(status().capacity))
