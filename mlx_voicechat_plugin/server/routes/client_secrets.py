"""``POST {prefix}/openai/v1/realtime/client_secrets``: an ephemeral key for a page.

With the server's API key (when it has one), the body (optional JSON)
``{"expires_after": {"anchor": "created_at", "seconds": N}, "session": {...}}``
mints a key (:mod:`..keys`) that opens one WebRTC call or one realtime
WebSocket within N seconds (60 by default, 10 to 7200), starting a call
with that GA session. The answer is OpenAI's:
``{"value": "ek_...", "expires_at": <Unix s>, "session": {...}}``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..dialects.ga.dialect import REALTIME_PATH
from ..keys import DEFAULT_SECONDS, EphemeralKeys, check_seconds
from .access import Access
from .calls import CallRefused, check_session

logger = logging.getLogger(__name__)

SECRETS_PATH = REALTIME_PATH + "/client_secrets"
MAX_BODY_BYTES = 256 * 1024


def parse_request(body: bytes) -> tuple[int, dict[str, Any] | None]:
    """``(seconds, session or None)`` of a mint request (:class:`CallRefused` when
    malformed)."""
    if not body.strip():
        return DEFAULT_SECONDS, None
    try:
        request = json.loads(body)
    except ValueError:
        raise CallRefused(400, "invalid_request", "the body must be a JSON object") from None
    if not isinstance(request, dict):
        raise CallRefused(400, "invalid_request", "the body must be a JSON object")
    expires = request.get("expires_after") or {}
    if not isinstance(expires, dict) or expires.get("anchor", "created_at") != "created_at":
        raise CallRefused(400, "invalid_request", "expires_after must be an object with "
                          "anchor 'created_at' and seconds", "expires_after")
    try:
        seconds = check_seconds(expires.get("seconds", DEFAULT_SECONDS))
    except ValueError as exc:
        raise CallRefused(400, "invalid_request", str(exc), "expires_after.seconds") from None
    session = request.get("session")
    return seconds, None if session is None else check_session(session, "session")


def client_secrets_router(keys: EphemeralKeys, access: Access, prefix: str = "") -> APIRouter:
    router = APIRouter(prefix=prefix)

    async def mint(request: Request) -> Response:
        try:
            if not access.origin_ok(request.headers.get("origin")):
                raise CallRefused(403, "origin_not_allowed", "origin not allowed")
            if not access.authorized(request.headers.get("authorization")):
                raise CallRefused(401, "invalid_api_key", "missing or invalid API key (an "
                                  "ephemeral key is minted with the server's key)")
            body = await request.body()
            if len(body) > MAX_BODY_BYTES:
                raise CallRefused(413, "invalid_request",
                                  f"request body exceeds {MAX_BODY_BYTES} bytes")
            seconds, session = parse_request(body)
            try:
                key = keys.mint(seconds, session)
            except OverflowError as exc:
                raise CallRefused(429, "rate_limit_exceeded", str(exc)) from None
        except CallRefused as refused:
            logger.info("client secret refused (%d): %s", refused.status, refused.message)
            return refused.response()
        logger.info("ephemeral key minted, valid %d s", seconds)
        return JSONResponse({"value": key.value, "expires_at": int(key.expires_at),
                             "session": session or {"type": "realtime"}})

    router.add_api_route(SECRETS_PATH, mint, methods=["POST"])
    return router
