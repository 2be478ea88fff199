"""Ephemeral keys: short-lived, single-use keys a page holds instead of the server's API key.

``POST /openai/v1/realtime/client_secrets`` (with the server's key) mints
one (:meth:`EphemeralKeys.mint`): ``ek_`` and 48 random hex characters,
valid for ``seconds`` (:data:`DEFAULT_SECONDS`, at most :data:`MAX_SECONDS`),
carrying the GA session the page starts with, kept as its JSON bytes (not a
parsed tree) within ``max_bytes`` for all keys held. A key opens one WebRTC
call or one realtime WebSocket (:meth:`EphemeralKeys.redeem`), then is
spent; an expired, spent or unknown key is refused with the reason
(:class:`KeyRefused`). The secret is compared in constant time; lookups go
by its first characters (an id, not the secret). At most ``max_keys`` keys
are kept (spent ones until they would have expired, so a reuse is told as
such); minting past either bound is refused. Keys live in the server's memory:
a restart forgets them. Thread-safe; never logged.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .limits import ServerLimits

PREFIX = "ek_"
ID_CHARS = 16  # the lookup part of a key (hex), before its secret part
KEY_HEX = 48
DEFAULT_SECONDS = 60
MIN_SECONDS, MAX_SECONDS = 10, 7200  # OpenAI's bounds for expires_after.seconds
DEFAULT_MAX_KEYS = 1024


# Why a key minted with a (GA) session opens no other dialect's route or call.
MINTED_ELSEWHERE = ("this ephemeral key was minted with a session: it opens the OpenAI "
                    "Realtime GA route (/openai/v1/realtime) or a call there")


class KeyRefused(Exception):
    """An ephemeral key that opens nothing; the message says why (for the 401)."""


@dataclass
class EphemeralKey:
    value: str
    expires_at: float  # Unix seconds
    session_json: bytes | None = field(default=None, repr=False)  # the minted GA session
    spent: bool = field(default=False, repr=False)

    @property
    def session(self) -> dict[str, Any] | None:
        """The GA session every connection made with the key starts with (``None``: none)."""
        return None if self.session_json is None else json.loads(self.session_json)


def is_ephemeral(token: str | None) -> bool:
    return bool(token) and token.startswith(PREFIX)


def check_seconds(value: Any) -> int:
    """``expires_after.seconds``: an integer within [:data:`MIN_SECONDS`, :data:`MAX_SECONDS`]."""
    if isinstance(value, bool) or not isinstance(value, int) \
            or not MIN_SECONDS <= value <= MAX_SECONDS:
        raise ValueError(f"expires_after.seconds must be an integer within [{MIN_SECONDS}, "
                         f"{MAX_SECONDS}], got {str(value)[:40]!r}")
    return value


class EphemeralKeys:
    """The server's ephemeral keys (``clock``: Unix seconds, replaceable in tests)."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS,
                 clock: Callable[[], float] = time.time,
                 max_bytes: int = ServerLimits.max_minted_bytes):
        self.max_keys, self.max_bytes = max_keys, max_bytes
        self.clock = clock
        self.bytes = 0  # the held keys' sessions
        self.keys: dict[str, EphemeralKey] = {}  # id -> key
        self.lock = threading.Lock()

    def mint(self, seconds: int = DEFAULT_SECONDS,
             session: dict[str, Any] | None = None) -> EphemeralKey:
        """A new key valid for ``seconds`` (``OverflowError`` when ``max_keys`` are held,
        or their sessions would pass ``max_bytes``)."""
        seconds = check_seconds(seconds)
        data = None if session is None else \
            json.dumps(session, ensure_ascii=False, separators=(",", ":")).encode()
        size = len(data or b"")
        with self.lock:
            self._prune()
            if len(self.keys) >= self.max_keys:
                raise OverflowError(f"{len(self.keys)} ephemeral keys are unexpired; "
                                    "try again once some expire")
            if self.bytes + size > self.max_bytes:
                raise OverflowError(f"the unexpired ephemeral keys' sessions hold "
                                    f"{self.bytes} bytes; this one's {size} would pass "
                                    f"{self.max_bytes} (--max-minted-bytes); try again once "
                                    "some expire")
            value = PREFIX + secrets.token_hex(KEY_HEX // 2)
            key = EphemeralKey(value, self.clock() + seconds, data)
            self.bytes += size
            self.keys[value[len(PREFIX):len(PREFIX) + ID_CHARS]] = key
            return key

    def redeem(self, token: str) -> EphemeralKey:
        """Spend ``token``: its key, or :class:`KeyRefused` (unknown, spent, expired)."""
        with self.lock:
            key = self._find(token)
            key.spent = True
            return key

    def check(self, token: str) -> EphemeralKey:
        """``token``'s key if it would be redeemed now (:class:`KeyRefused` if not); not spent."""
        with self.lock:
            return self._find(token)

    def _find(self, token: str) -> EphemeralKey:
        key = self.keys.get(token[len(PREFIX):len(PREFIX) + ID_CHARS]) \
            if is_ephemeral(token) else None
        if key is None or not hmac.compare_digest(key.value.encode(), token.encode()):
            raise KeyRefused("invalid ephemeral key")
        if self.clock() >= key.expires_at:
            raise KeyRefused("ephemeral key expired; mint a new one")
        if key.spent:
            raise KeyRefused("ephemeral key already used: a key opens one session; "
                             "mint a new one")
        return key

    def _prune(self) -> None:
        now = self.clock()
        for ident in [i for i, key in self.keys.items() if now >= key.expires_at]:
            self.bytes -= len(self.keys.pop(ident).session_json or b"")

    def __len__(self) -> int:
        with self.lock:
            self._prune()
            return len(self.keys)
