"""Resume tokens: which session a re-attaching client names, and who may take it (event loop).

A resumable session (``--resume-seconds`` above 0) is given a token when it
is made (:meth:`Resumes.issue`): unguessable, bound to the API key that
opened it (a digest of it is kept, never the key), and naming the replica
when a balancer said which one took the connection (HAProxy's
``http-send-name-header``: the token starts ``<server>.``, and the shipped
``deploy/haproxy.cfg`` routes a resume on that prefix). A client that lost
its connection opens the same path with ``?resume_token=...&last_seq=N``;
:meth:`Resumes.claim` finds the session or says why not (:class:`Refused`,
an HTTP status with a code and a message): an unknown token or a token of
another key (one answer for both, given before anything else: a client
without the token's key learns nothing about it), a session that has ended
(its window passed, it was committed, the replica drained), a resume at
another dialect's path, a session being resumed by another connection, a
``last_seq`` past what was sent, or one whose events after it are no longer
held (then the session ends: it cannot be made whole). A refused claim
leaves the session as it was, except the last: the events are gone. A
session still attached when a valid resume
comes (the server has not seen its old connection drop: a half-open TCP
connection is seen only when pings time out) is taken over, as MQTT takes
over a client id: the old connection is closed (1000, "the session was
resumed on another connection") and the resume goes on.

A detached session holds its slot only while no one else needs it. A
session that finds the server full once it opens (configured, or sending
audio) takes the slot of a detached one (:meth:`Resumes.reclaim`, asked by
the engine's admission): the longest-detached of the key that holds the most
sessions, so no key keeps more than its share while others wait. That
session ends, and a resume of it is refused (410 ``session_expired``) saying
its slot was given to a new connection. One API key holds at most
``--max-detached-per-key`` detached sessions: past it its oldest ends (a
client that opens and drops connections in a loop holds no one's slot). A
session opened with an ephemeral key counts against the key that minted it
(its owner), not the ephemeral key, so minting a key per connection holds
no more.

``/metrics`` counts the sessions detached, resumed, expired (released while
detached) and reclaimed (of those, ended for a newcomer's slot), and how
many are detached now.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from ...quoting import brief
from ..limits import DEFAULT_MAX_DETACHED_PER_KEY
from .session import SLOT_TAKEN, Session

logger = logging.getLogger(__name__)

TOKEN_BYTES = 24  # of randomness: 32 URL-safe characters, no dots
ENDED_KEPT = 1024  # ended sessions' tokens remembered, to say why a resume came too late
REPLICA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
REPLICA_HEADER = "x-voicechat-server"  # HAProxy's http-send-name-header (deploy/haproxy.cfg)
BOUND_KEY = object()  # a session's owner is the key its token is bound to (the default)


@dataclass(frozen=True)
class Refused(Exception):
    """A resume refused: the HTTP ``status`` of the upgrade's denial, a ``code`` and why."""

    status: int
    code: str
    message: str


def key_digest(key: str | None) -> bytes:
    return hashlib.sha256(("" if key is None else "k:" + key).encode()).digest()


MAX_SEQ_DIGITS = 20  # a seq is a count of events: 20 digits outlast any session


def parse_last_seq(value: str | None, sent: int) -> int:
    """``?last_seq=``: the last event the client read, ``0`` to ``sent``."""
    # ASCII digits only (``int`` takes other scripts' digits), and few enough that
    # ``int`` takes them at all.
    if value is None or not (value.isascii() and value.isdigit()) \
            or len(value) > MAX_SEQ_DIGITS or int(value) > sent:
        raise Refused(400, "invalid_request",
                      f"last_seq must be an integer from 0 to {sent} (the last seq read), "
                      f"got {brief(value)}")
    return int(value)


class Resumes:
    """The replica's resumable sessions by token, and the resume figures."""

    def __init__(self, registry: Any = None,
                 max_detached_per_key: int = DEFAULT_MAX_DETACHED_PER_KEY):
        self.sessions: dict[str, Session] = {}
        self.keys: dict[str, bytes] = {}  # token -> the digest of the key it is bound to
        self.owners: dict[str, bytes] = {}  # token -> its owner's digest (the minting key)
        # token -> why its session ended, and the digest of the key it was bound to
        self.ended: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self.max_detached_per_key = max_detached_per_key
        self.counts = {"detached": 0, "resumed": 0, "expired": 0, "reclaimed": 0}
        if registry is not None:
            self._metrics(registry)

    def _metrics(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        self.detached_total = Counter("voicechat_sessions_detached",
                                      "Sessions whose connection dropped and which waited "
                                      "to be resumed (--resume-seconds)", registry=registry)
        self.resumed_total = Counter("voicechat_sessions_resumed",
                                     "Detached sessions resumed on a new connection",
                                     registry=registry)
        self.expired_total = Counter("voicechat_sessions_resume_expired",
                                     "Detached sessions released without a resume (window "
                                     "passed, replay bound, drain)", registry=registry)
        self.reclaimed_total = Counter("voicechat_sessions_reclaimed",
                                       "Detached sessions ended because a connection that "
                                       "found the server full took their slot",
                                       registry=registry)
        Gauge("voicechat_detached_sessions", "Sessions detached now, awaiting a resume",
              registry=registry).set_function(lambda: float(self.detached_now()))

    def detached_now(self) -> int:
        return sum(1 for s in list(self.sessions.values()) if s.detached_or_claimed)

    def waiting(self) -> list[Session]:
        """The detached sessions still awaiting a resume (none being resumed or ending),
        longest-detached first."""
        return sorted((s for s in list(self.sessions.values())
                       if s.detached_or_claimed and not (s.claimed or s.ended or s.released)),
                      key=lambda s: s.detached_at)

    # --- slots for newcomers (the engine's admission asks) -----------------------------

    def reclaim(self) -> bool:
        """End the longest-detached session so a connection that found the server full
        takes its slot (free at once); ``False`` when none waits."""
        waiting = self.waiting()
        if not waiting:
            return False
        held = Counter(self.owners.get(t) for t, s in list(self.sessions.items())
                       if not s.released)
        fairest = min(waiting, key=lambda s: (-held[self.owners.get(s.resume_token)],
                                              s.detached_at))
        self._count("reclaimed")
        fairest.end_detached(SLOT_TAKEN)
        return True

    def reclaimable(self) -> list[str]:
        return [s.session_id for s in self.waiting()]

    def _count(self, what: str) -> None:
        self.counts[what] += 1
        counter = getattr(self, f"{what}_total", None)
        if counter is not None:
            counter.inc()

    # --- tokens ---------------------------------------------------------------------

    def issue(self, session: Session, key: str | None, replica: str | None = None,
              owner: Any = BOUND_KEY) -> str:
        """Make ``session`` resumable: its token, bound to ``key``, naming ``replica``;
        counted against ``owner`` (the key that minted an ephemeral ``key``; by default
        ``key``)."""
        secret = secrets.token_urlsafe(TOKEN_BYTES)
        name = replica if replica and REPLICA_NAME.fullmatch(replica) else None
        token = f"{name}.{secret}" if name else secret
        session.make_resumable(token, self)
        self.sessions[token] = session
        self.keys[token] = key_digest(key)
        self.owners[token] = key_digest(key if owner is BOUND_KEY else owner)
        return token

    def detached(self, session: Session) -> None:
        """``session`` detached: counted; past ``max_detached_per_key`` of its key's
        detached sessions, the oldest ends."""
        self._count("detached")
        owner = self.owners.get(session.resume_token)
        same = [s for s in self.waiting() if self.owners.get(s.resume_token) == owner]
        for oldest in same[:max(len(same) - self.max_detached_per_key, 0)]:
            oldest.end_detached(f"its API key holds more than {self.max_detached_per_key} "
                                "detached sessions (--max-detached-per-key)")

    def resumed(self, session: Session) -> None:
        self._count("resumed")

    def released(self, session: Session) -> None:
        token = session.resume_token
        self.sessions.pop(token, None)
        digest = self.keys.pop(token, key_digest(None))
        self.owners.pop(token, None)
        if session.detached_or_claimed:
            self._count("expired")
        self.ended[token] = (session.ended or "the session ended", digest)
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def claim(self, token: str, key: str | None, last_seq: str | None,
              dialect: type | None = None) -> tuple[Session, int]:
        """The session ``token`` names, for a client with ``key`` that read up to
        ``last_seq`` at ``dialect``'s path; detached (taken from a link the server still
        holds: :meth:`take_over`) and marked as being resumed.
        :class:`Refused` says why not."""
        session = self.sessions.get(token)
        live = session is not None and not session.released
        reason, bound = (None, self.keys.get(token)) if live else \
            self.ended.get(token, (None, None))
        # The key first: a token of another key (or a made-up key) is told nothing about
        # the token, not whether it is live, ended or unknown.
        if bound is None or not hmac.compare_digest(bound, key_digest(key)):
            raise Refused(404, "session_not_found", "unknown resume_token for this key (no "
                                                    "such session on this replica)")
        if not live:
            raise Refused(410, "session_expired",
                          f"the session of this resume_token has ended: {reason}")
        if dialect is not None and not isinstance(session.dialect, dialect):
            raise Refused(409, "invalid_request",
                          "resume a session at the path (the dialect) that opened it")
        if session.claimed:
            raise Refused(409, "session_attached", "the session is being resumed by another "
                                                   "connection")
        seq = parse_last_seq(last_seq, session.replay.seq)
        if not session.replay.held(seq):
            reason = (f"the events after seq {seq} are no longer held "
                      f"(--max-replay-seconds {session.limits.max_replay_seconds:g})")
            if session.detached_or_claimed:  # nobody can be made whole: end it
                session.end_detached(reason)
            raise Refused(410, "session_expired", f"the session cannot be resumed: {reason}")
        if not session.detached_or_claimed and not self.take_over(session):
            raise Refused(409, "session_attached", "the session is attached to another "
                                                   "connection and cannot be taken now")
        session.claim()
        return session, seq

    @staticmethod
    def take_over(session: Session) -> bool:
        """Take a resumable session from the link it still has, for a resume: the server
        has not seen that link drop (a half-open connection, seen only when its pings
        time out) while the client holding its token and key is back. The old link
        stops reading and closes; the session is detached, ready to be claimed.
        ``False`` (nothing done) when there is no link to take or the server drains."""
        link = session.link
        if (link is None or session.detached_or_claimed or session.released or session.claimed
                or session.resume_token is None or session.engine.admission.draining):
            return False
        link.supersede()
        logger.info("%s taken over by a resume from its old transport", session.session_id)
        session.detach()
        return True

    async def end_all(self, reason: str) -> None:
        """Release every detached session (the replica drains or stops)."""
        for session in [s for s in self.sessions.values() if s.detached_or_claimed]:
            session.end_detached(reason)
            await session.release()
