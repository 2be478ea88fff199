"""GPT-Live WebRTC sessions as OpenAI makes them: ``POST {prefix}/openai/v1/live/sessions``.

The body is JSON, ``{"session": <MediaSessionConfig>, "transport": {"type": "webrtc",
"sdp": <offer>}}`` (the openai SDK's ``client.live.create``); the answer is ``200`` with
``{"session": {"id"}, "transport": {"type": "webrtc", "sdp": <answer>}}``. Creating the
session starts it: the session's ``session.start`` is handled first, and
``session.started`` is the data channel's first event. The call is then a GPT-Live
session over a :class:`~..transport.webrtc.WebRTCTransport` (the same connection,
dialect and engine as the WebSocket at the same path); ``POST .../{session_id}/hangup``
ends it, as the peer connection closing does. Keys, ``Origin``, admission and refusals
are the GA calls' (:mod:`.calls`); an ephemeral key's GA session does not apply here.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..dialects.live.config import LiveError, media_session
from ..dialects.live.dialect import LIVE_PATH, LiveDialect
from .calls import NO_WEBRTC, CallRefused, Calls, authorize, read_body

logger = logging.getLogger(__name__)


async def read_request(request: Request, limit: int) -> tuple[str, dict[str, Any]]:
    """``(SDP offer, session start)`` from the JSON body."""
    try:
        payload = json.loads(await read_body(request, limit))
    except ValueError:
        raise CallRefused(400, "invalid_request", "the body must be JSON with session and "
                                                  "transport") from None
    if not isinstance(payload, dict):
        raise CallRefused(400, "invalid_request", "the body must be a JSON object")
    for key in payload:
        if key not in ("session", "transport"):
            raise CallRefused(400, "unknown_parameter", f"Unknown parameter: '{key}'.", key)
    transport = payload.get("transport")
    if not isinstance(transport, dict) or transport.get("type") != "webrtc" \
            or not isinstance(transport.get("sdp"), str):
        raise CallRefused(400, "invalid_value", "transport must be {\"type\": \"webrtc\", "
                                                "\"sdp\": <offer>}", "transport")
    try:
        start = media_session(payload.get("session"))
    except LiveError as exc:
        raise CallRefused(400, exc.code, exc.message, exc.param) from None
    return transport["sdp"], start


class LiveSessions(Calls):
    """The open GPT-Live WebRTC sessions, and the routes that make and end them."""

    async def _create(self, request: Request) -> Response:
        if self.transport_class is None:
            raise CallRefused(501, "unsupported", NO_WEBRTC.format(path=self.prefix + LIVE_PATH))
        if not self.access.origin_ok(request.headers.get("origin")):
            raise CallRefused(403, "origin_not_allowed", "origin not allowed")
        key = authorize(self.access, self.keys, request.headers.get("authorization"))
        offer, start = await read_request(request, self.limits.max_message_bytes)
        session_id, answer = await self.place(
            LiveDialect, key, offer, [{"type": "session.start", "session": start}],
            lambda session_id: session_id)
        return JSONResponse({"session": {"id": session_id},
                             "transport": {"type": "webrtc", "sdp": answer}})

    def router(self) -> APIRouter:
        router = APIRouter(prefix=self.prefix)
        router.add_api_route(LIVE_PATH, self.create, methods=["POST"])
        router.add_api_route(LIVE_PATH + "/{call_id}/hangup", self.hang_up, methods=["POST"])
        return router
