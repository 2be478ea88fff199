"""Who may use a route: the API key and a browser's ``Origin``, checked on the event loop.

The key is ``api_key`` (``--api-key``) when given; otherwise, as mlx-vlm's
own server does, ``MLX_VLM_SERVER_API_KEY`` read on every request, so a key
set in the environment always guards the server, and an empty one is none.
A browser, which cannot set headers on a WebSocket, may send the key as the
``openai-insecure-api-key.<KEY>`` subprotocol beside ``realtime``; either may
carry an ephemeral key instead (:func:`ephemeral_token`). The API key is
never logged.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit

from fastapi import WebSocket
from fastapi.responses import JSONResponse

from ..keys import is_ephemeral

KEY_SUBPROTOCOL = "openai-insecure-api-key."  # + the API key (OpenAI's browser examples)
REALTIME_SUBPROTOCOL = "realtime"
API_KEY_ENV = "MLX_VLM_SERVER_API_KEY"  # mlx-vlm's key variable, read per request
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def origin_allowed(origin: str | None, allowed: Sequence[str]) -> bool:
    """Whether a WebSocket upgrade's ``Origin`` may connect.

    No ``Origin`` header: not a browser, allowed (API keys guard those). A
    browser's origin must be in ``allowed`` (or ``allowed`` has ``*``); with no
    list, only a loopback origin (``http(s)://localhost``, ``127.0.0.1`` or
    ``[::1]``, any port). Never judged from ``Host``, which a DNS-rebinding
    page controls. Empty, ``null`` and non-http(s) origins are refused.
    """
    if origin is None:
        return True
    origin = origin.strip().rstrip("/")
    try:
        parts = urlsplit(origin)
        hostname = parts.hostname
        parts.port  # raises on a malformed port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not hostname:
        return False
    if allowed:
        return "*" in allowed or origin.lower() in (o.lower() for o in allowed)
    return hostname.lower() in LOOPBACK_HOSTS


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if it is one."""
    scheme, _, token = (header or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_ok(header: str | None, api_key: str | None) -> bool:
    if not api_key:
        return True
    token = bearer_token(header)
    return token is not None and hmac.compare_digest(token.encode(), api_key.encode())


def query_key_ok(value: str | None, api_key: str | None) -> bool:
    """A ``?api_key=`` query parameter (the dialects that take one) against the key."""
    if not api_key:
        return True
    return value is not None and hmac.compare_digest(value.encode(), api_key.encode())


def websocket_auth(websocket: WebSocket, api_key: str | None) -> tuple[bool, str | None]:
    """Whether an upgrade carries the API key, and the subprotocol to select.

    The key comes as ``Authorization: Bearer <KEY>`` or, from a browser, as the
    subprotocol ``openai-insecure-api-key.<KEY>`` (compared in constant time,
    never logged, never echoed: the server selects ``realtime`` when offered).
    """
    offered = [str(p) for p in websocket.scope.get("subprotocols") or ()]
    selected = REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in offered else None
    if bearer_ok(websocket.headers.get("authorization"), api_key):
        return True, selected
    keys = [p[len(KEY_SUBPROTOCOL):] for p in offered if p.startswith(KEY_SUBPROTOCOL)]
    ok = any(hmac.compare_digest(key.encode(), api_key.encode()) for key in keys)
    return ok, selected


def ephemeral_token(websocket: WebSocket) -> str | None:
    """The ephemeral key (``ek_...``, :mod:`..keys`) an upgrade carries as its bearer token
    or key subprotocol, if any."""
    token = bearer_token(websocket.headers.get("authorization"))
    offered = [token] if token is not None else []
    offered += [str(p)[len(KEY_SUBPROTOCOL):] for p in websocket.scope.get("subprotocols") or ()
                if str(p).startswith(KEY_SUBPROTOCOL)]
    return next((t for t in offered if is_ephemeral(t)), None)


def invalid_key() -> JSONResponse:
    """The 401 an HTTP route answers without the key (OpenAI's error shape)."""
    return JSONResponse({"error": {"code": "invalid_api_key", "type": "invalid_request_error",
                                   "message": "missing or invalid API key"}}, 401)


@dataclass(frozen=True)
class Access:
    """The server's key and allowed origins, as every route checks them.

    Without ``api_key``, the key is the ``api_key_env`` variable's value at
    each request (none while it is unset or empty).
    """

    api_key: str | None = None
    api_key_env: str | None = API_KEY_ENV
    origins: tuple[str, ...] = ()

    @classmethod
    def of(cls, api_key: str | None, api_key_env: str | None,
           allowed_origins: Sequence[str]) -> "Access":
        return cls(api_key, api_key_env, tuple(o.rstrip("/") for o in allowed_origins))

    def current_key(self) -> str | None:
        """``--api-key``, else the key variable as it is now (mlx-vlm reads it per request)."""
        env = self.api_key_env
        return self.api_key or (os.environ.get(env) if env else None) or None

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the key (always, with none set)."""
        return bearer_ok(header, self.current_key())

    def origin_ok(self, origin: str | None) -> bool:
        return origin_allowed(origin, self.origins)
