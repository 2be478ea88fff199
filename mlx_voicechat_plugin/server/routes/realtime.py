"""The realtime WebSocket routes: each dialect at its paths, after the API key, ``Origin``
and ``?model=`` checks (a dialect with ``any_model`` takes any name unless the server
is ``--strict-model``: :meth:`.models.ServedModel.accepts`). Event loop.

Each registered dialect (:data:`..dialects.DIALECTS` by default: mlx-vlm's at
``/v1/realtime``, OpenAI Realtime GA's at ``/openai/v1/realtime``, NVIDIA's VoiceChat at
``/nvidia/v1/realtime`` with its ``/health``) is served
at its paths; all share the engine's sessions. An upgrade refused before it
is accepted gets an HTTP denial response where the server supports one, else
a policy-violation close.

An ephemeral key minted with a session opens its connection with it, as a
WebRTC call does (:meth:`~..dialects.base.Dialect.bind`): the first message
handled is that ``session.update``, and what it fixes stays fixed.

With ``--resume-seconds`` each new session gets a resume token
(:mod:`..session.resume`); an upgrade with ``?resume_token=...&last_seq=N`` (after
the same key and ``Origin`` checks) re-attaches the session it names, in its
own dialect (taking it from an old connection the server still holds), or is
denied with the reason (404 unknown, 410 ended, 403 another key's, 409 being
resumed by another connection or another dialect's path, 400 a bad
``last_seq``).
"""

from __future__ import annotations

import json
import logging
from typing import Sequence

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect, WebSocketState

from ...quoting import brief
from ..connection import Connection, connect
from ..dialects.base import Dialect
from ..engine.thread import Engine
from ..limits import ServerLimits
from ..mcp.manager import McpManager
from ..messages import Hangup
from ..operations.drain import Drain
from ..session.resume import REPLICA_HEADER, Refused, Resumes
from ..transport.websocket import ReadRate, WebSocketTransport
from ..wire import CloseCode
from ..keys import MINTED_ELSEWHERE, EphemeralKeys, KeyRefused
from .access import Access, ephemeral_token, query_key_ok, websocket_auth
from .models import ServedModel

logger = logging.getLogger(__name__)


async def deny(websocket: WebSocket, status: int, message: str,
               code: str = "invalid_request", dialect: type[Dialect] | None = None) -> None:
    """Refuse an upgrade: ``status`` with an error body (in ``dialect``'s error shape,
    when it is known), or a close where no denial is possible."""
    logger.info("rejected upgrade: %s", message)
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        body = dialect.refusal(code, message) if dialect is not None else \
            {"error": {"code": code, "message": message}}
        await websocket.send_denial_response(JSONResponse(body, status))
    else:
        await websocket.close(code=CloseCode.POLICY_VIOLATION)


def unknown_path_router(paths: Sequence[str]) -> APIRouter:
    """A WebSocket to any other path: 404 naming the realtime paths (not the host's 403,
    which reads as an authentication failure). Include it last."""
    router = APIRouter()

    async def unknown(websocket: WebSocket) -> None:
        await deny(websocket, 404, f"no WebSocket endpoint at {brief(websocket.url.path)}; "
                   f"the realtime endpoints are {', '.join(paths)}", "not_found")

    router.add_api_websocket_route("/{path:path}", unknown, name="unknown WebSocket path")
    return router


class Realtime:
    """Serves one upgrade in a dialect: checks it, then runs its connection (a WebSocket
    transport, a new session in the dialect) under the drain."""

    mcp: McpManager | None = None  # the operator's MCP servers (the app sets it)

    def __init__(self, engine: Engine, drain: Drain, served: ServedModel, limits: ServerLimits,
                 access: Access, keys: EphemeralKeys | None = None,
                 resumes: Resumes | None = None):
        self.engine, self.drain, self.served = engine, drain, served
        self.limits, self.access = limits, access
        self.keys = keys if keys is not None else EphemeralKeys()
        self.resumes = resumes if resumes is not None else Resumes()

    async def serve(self, websocket: WebSocket, dialect: type[Dialect]) -> None:
        key = self.access.current_key()
        allowed, subprotocol = websocket_auth(websocket, key)
        if not allowed and dialect.query_key:
            allowed = query_key_ok(websocket.query_params.get("api_key"), key)
        ephemeral = None if allowed else ephemeral_token(websocket)
        if not allowed and ephemeral is None:
            await deny(websocket, 401, "missing or invalid API key")
            return
        token = websocket.query_params.get("resume_token")
        # A session opened with an ephemeral key resumes with that (spent) key: the
        # resume token is bound to it, so the claim below is the check.
        spend = ephemeral if token is None else None
        held = None
        try:
            if spend is not None:
                held = self.keys.check(spend)  # spent below, once every check has passed
        except KeyRefused as exc:
            await deny(websocket, 401, str(exc))
            return
        if not self.access.origin_ok(websocket.headers.get("origin")):
            await deny(websocket, 403, "origin not allowed")
            return
        asked = websocket.query_params.get("model")
        if not self.served.accepts(asked, dialect.any_model):
            await deny(websocket, 404, self.served.not_served(asked))
            return
        minted = held.session if held is not None else None
        if minted is not None and not dialect.binds_minted:
            await deny(websocket, 403, MINTED_ELSEWHERE)
            return
        try:
            if spend is not None:
                self.keys.redeem(spend)
        except KeyRefused as exc:
            await deny(websocket, 401, str(exc))
            return
        limits = self.limits
        transport = WebSocketTransport(
            websocket, limits.max_pending_events, limits.send_timeout, subprotocol,
            max_pending_bytes=limits.max_pending_bytes,
            read_rate=ReadRate(limits.max_read_bytes_per_second, limits.read_burst_bytes))
        opener = ephemeral if ephemeral is not None else key  # what the token is bound to
        if token is not None:
            connection = await self.resuming(websocket, transport, dialect, token, opener)
            if connection is None:
                return
        else:
            connection = connect(transport, dialect, self.engine, self.served.model_id, limits,
                                 self.mcp)
            if minted is not None:  # the key's session binds the connection, as a call's
                connection.inject(json.dumps(connection.dialect.bind(minted)))
            if limits.resumable:
                self.resumes.issue(connection.session, opener,
                                   websocket.headers.get(REPLICA_HEADER), owner=key)
        try:
            await self.drain.serve(connection)  # connection.run(), ended by a graceful stop
        except (WebSocketDisconnect, Hangup):
            pass
        except Exception as exc:  # e.g. sending after the client went away
            if websocket.client_state == WebSocketState.DISCONNECTED:
                logger.info("%s ended: client gone (%s)", connection.session_id, exc)
            else:
                logger.exception("%s failed", connection.session_id)

    async def resuming(self, websocket: WebSocket, transport: WebSocketTransport,
                       dialect: type[Dialect], token: str, key: str | None) -> Connection | None:
        """The connection that re-attaches the session ``token`` names (``None``: denied)."""
        try:
            if not self.limits.resumable:
                raise Refused(404, "session_not_found",
                              "sessions are not resumable here (--resume-seconds 0)")
            session, last_seq = self.resumes.claim(
                token, key, websocket.query_params.get("last_seq"), dialect)
        except Refused as refused:
            await deny(websocket, refused.status, refused.message, refused.code, dialect)
            return None
        return Connection(transport, session, resumed=True, last_seq=last_seq)

    def router(self, dialects: Sequence[type[Dialect]], prefix: str = "") -> APIRouter:
        """Each dialect's WebSocket route at each of its paths."""
        router = APIRouter(prefix=prefix)
        for dialect in dialects:
            endpoint = self._endpoint(dialect)
            for path in dialect.paths:
                router.add_api_websocket_route(path, endpoint, name=dialect.name)
                if dialect.health:
                    router.add_api_route(path + "/health", self.health, methods=["GET"],
                                         name=f"{dialect.name} health")
        return router

    async def health(self) -> JSONResponse:
        """A dialect's own readiness route (unauthenticated, as NeMo-Speech.cpp's):
        200 once the model is loaded, 503 before."""
        ready = self.engine.ready and not self.drain.draining
        return JSONResponse({"status": "ok" if ready else "unavailable", "ready": ready,
                             "model": self.served.model_id}, 200 if ready else 503)

    def _endpoint(self, dialect: type[Dialect]):
        async def realtime(websocket: WebSocket) -> None:
            await self.serve(websocket, dialect)

        return realtime
