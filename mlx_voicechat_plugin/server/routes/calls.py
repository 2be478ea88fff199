"""WebRTC calls as OpenAI Realtime GA makes them: ``POST {prefix}/openai/v1/realtime/calls``.

The body is the client's SDP offer (``application/sdp``), or a
``multipart/form-data`` form with ``sdp`` and ``session`` (a GA session
object, as in ``session.update``). The answer is ``201`` with the SDP answer
and ``Location: .../calls/{call_id}``; the call is then a GA session over a
:class:`~..transport.webrtc.WebRTCTransport`, served by the same
connection, dialect and engine as the GA WebSocket. ``DELETE`` on the
Location (or ``POST .../calls/{call_id}/hangup``) ends it, as the peer
connection closing does, and releases the session like a closed socket.

Who may call: the server's API key or an ephemeral key (``ek_...``, spent by
the call: :mod:`..keys`) as ``Authorization: Bearer``, no key when the
server has none; a browser's ``Origin`` as on the WebSocket routes. A call
takes a session slot before anything is made for it (``--max-sessions``:
429, nothing allocated). Refusals are OpenAI's error object, with the
reason. Without aiortc (the ``webrtc`` extra) the route answers 501.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from ..connection import Connection, connect
from ..dialects.ga.dialect import REALTIME_PATH, GADialect
from ..dialects.ga.config import GAConfig, merge_session
from ..engine.admission import Slot
from ..engine.thread import Engine
from ..keys import MINTED_ELSEWHERE, EphemeralKey, EphemeralKeys, KeyRefused, is_ephemeral
from ..limits import ServerLimits
from ..mcp.manager import McpManager
from ..operations.drain import Drain
from ..transport.ice import ICEConfig
from ..transport.websocket import ReadRate
from ..wire import ProtocolError
from .access import Access, bearer_token

logger = logging.getLogger(__name__)

CALLS_PATH = REALTIME_PATH + "/calls"
NO_WEBRTC = ("WebRTC needs aiortc, which is not installed: pip install "
             "'mlx-voicechat-plugin[webrtc]' (the GA WebSocket at {path} works without it)")


class CallRefused(Exception):
    """A call refused before it starts: ``status`` and OpenAI's error object."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind,
                                       "code": self.code, "param": self.param}}, self.status)


def authorize(access: Access, keys: EphemeralKeys, header: str | None
              ) -> EphemeralKey | None:
    """The ephemeral key a request carries (checked, not spent), ``None`` for the server's
    key or none needed; :class:`CallRefused` (401) otherwise."""
    token = bearer_token(header)
    if is_ephemeral(token):
        try:
            return keys.check(token)
        except KeyRefused as exc:
            raise CallRefused(401, "invalid_api_key", str(exc)) from None
    if not access.authorized(header):
        raise CallRefused(401, "invalid_api_key", "missing or invalid API key")
    return None


def check_session(session: Any, where: str) -> dict[str, Any]:
    """A GA session object (checked as ``session.update`` checks it)."""
    if not isinstance(session, dict):
        raise CallRefused(400, "invalid_request", f"{where} must be a JSON object", where)
    try:
        merge_session(GAConfig(), session)
    except ProtocolError as exc:
        raise CallRefused(400, exc.code, exc.message, where) from None
    return session


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes (413 past them)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise CallRefused(413, "invalid_request", f"request body exceeds the {limit}-byte "
                                                      "limit (--max-message-bytes)")
    return bytes(body)


async def read_offer(request: Request, limit: int) -> tuple[str, dict[str, Any] | None]:
    """``(SDP offer, session or None)`` from an ``application/sdp`` body or the form."""
    body = await read_body(request, limit)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "multipart/form-data":
        if kind not in ("application/sdp", "text/plain", ""):
            raise CallRefused(415, "invalid_request", "the body must be the SDP offer "
                              "(application/sdp) or a multipart/form-data form with sdp "
                              f"and session, got {kind[:60]!r}")
        return _text(bytes(body), "sdp"), None

    async def replay() -> AsyncIterator[bytes]:
        yield bytes(body)

    try:
        form = await MultiPartParser(request.headers, replay(), max_files=2,
                                     max_fields=8).parse()
    except MultiPartException as exc:
        raise CallRefused(400, "invalid_request", f"malformed multipart form: {exc.message}")
    fields = {name: await _field(form.get(name), name) for name in ("sdp", "session")}
    if fields["sdp"] is None:
        raise CallRefused(400, "invalid_request", "the form has no sdp field (the offer)", "sdp")
    session = None
    if fields["session"] is not None:
        try:
            session = json.loads(fields["session"])
        except ValueError:
            raise CallRefused(400, "invalid_request", "session must be JSON", "session") from None
    return fields["sdp"], session


async def _field(value: Any, name: str) -> str | None:
    if isinstance(value, UploadFile):
        data = await value.read()
        await value.close()
        return _text(data, name)
    return value


def _text(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CallRefused(400, "invalid_request", f"{name} must be UTF-8 text", name) from None


class Calls:
    """The open calls, and the routes that make and end them."""

    mcp: McpManager | None = None  # the operator's MCP servers (the app sets it)

    def __init__(self, engine: Engine, drain: Drain, model_id: str, limits: ServerLimits,
                 access: Access, keys: EphemeralKeys, ice: ICEConfig, prefix: str = ""):
        self.engine, self.drain, self.model_id = engine, drain, model_id
        self.limits, self.access, self.keys, self.ice = limits, access, keys, ice
        self.prefix = prefix
        self.open: dict[str, tuple[Any, EphemeralKey | None]] = {}  # call id -> transport, key
        self.tasks: dict[str, asyncio.Task] = {}  # call id -> its connection's run
        try:
            from ..transport.webrtc import OfferError, WebRTCTransport
        except ImportError as exc:
            logger.info("WebRTC calls are off: %s", exc)
            self.transport_class = self.offer_error = None
        else:
            self.transport_class, self.offer_error = WebRTCTransport, OfferError

    async def create(self, request: Request) -> Response:
        try:
            return await self._create(request)
        except CallRefused as refused:
            logger.info("call refused (%d): %s", refused.status, refused.message)
            return refused.response()

    async def _create(self, request: Request) -> Response:
        if self.transport_class is None:
            raise CallRefused(501, "unsupported", NO_WEBRTC.format(
                path=self.prefix + REALTIME_PATH))
        if not self.access.origin_ok(request.headers.get("origin")):
            raise CallRefused(403, "origin_not_allowed", "origin not allowed")
        key = authorize(self.access, self.keys, request.headers.get("authorization"))
        offer, session = await read_offer(request, self.limits.max_message_bytes)
        own = [check_session(session, "session")] if session is not None else []
        call_id, answer = await self.place(
            GADialect, key, offer, [{"type": "session.update", "session": update}
                                    for update in own],  # after the key's (place binds it)
            lambda session_id: "rtc_" + session_id.partition("_")[2])
        location = f"{self.prefix}{CALLS_PATH}/{call_id}"
        return Response(answer, 201, {"Location": location}, media_type="application/sdp")

    async def place(self, dialect: Any, key: EphemeralKey | None, offer: str,
                    first: list[dict[str, Any]], name: Any) -> tuple[str, str]:
        """Admit and answer one call in ``dialect``, its session handling ``first`` before
        anything the client sends (after an ephemeral key's minted session, which binds
        it: :meth:`~..dialects.base.Dialect.bind`): ``(call id, SDP answer)``; the call
        id is ``name(session_id)``."""
        minted = key.session if key is not None else None  # checked when minted
        if minted is not None and not dialect.binds_minted:
            raise CallRefused(403, "invalid_api_key", MINTED_ELSEWHERE)
        engine = self.engine
        if not engine.ready or engine.admission.draining:
            raise CallRefused(503, "server_busy", "the server is shutting down"
                              if engine.admission.draining else "the model is not loaded")
        call_id: list[str] = []
        transport = self.transport_class(self.limits.max_pending_events,
                                         self.limits.send_timeout,
                                         on_end=lambda: self.open.pop(call_id[0], None),
                                         max_pending_bytes=self.limits.max_pending_bytes,
                                         read_rate=ReadRate(self.limits.max_read_bytes_per_second,
                                                            self.limits.read_burst_bytes))
        connection = connect(transport, dialect, engine, self.model_id, self.limits,
                             self.mcp)
        call_id.append(name(connection.session_id))
        admission = engine.admission
        # A detached session's slot goes to a call only once its offer is answered.
        slot = await admission.accept(connection.session_id)
        if slot is Slot.REFUSED:
            await connection.session.release()
            raise CallRefused(429, "server_busy", admission.refusal)
        held = slot is Slot.HELD
        connection.admitted = True
        self.open[call_id[0]] = (transport, key)
        try:
            answer = await transport.answer(offer, self.ice)
            if not (held or await admission.reserve(connection.session_id)):
                raise CallRefused(429, "server_busy", admission.refusal)
            if key is not None:
                self.keys.redeem(key.value)
        except BaseException as exc:
            await connection.session.release()
            await transport.stop()
            if isinstance(exc, self.offer_error):
                raise CallRefused(400, "invalid_offer", str(exc), "sdp") from None
            if isinstance(exc, KeyRefused):
                raise CallRefused(401, "invalid_api_key", str(exc)) from None
            raise
        if minted is not None:  # the key's session binds the call, before the rest
            first = [connection.dialect.bind(minted), *first]
        for message in first:
            transport.inject(json.dumps(message))
        self.tasks[call_id[0]] = asyncio.ensure_future(self.run(call_id[0], connection))
        logger.info("%s call %s answered", connection.session_id, call_id[0])
        return call_id[0], answer

    async def run(self, call_id: str, connection: Connection) -> None:
        try:
            await self.drain.serve(connection)
        except Exception:
            logger.exception("call %s failed", call_id)
        finally:
            self.tasks.pop(call_id, None)

    async def hang_up(self, request: Request) -> Response:
        """End a call (the server's key, or the ephemeral key that opened it)."""
        call_id = request.path_params["call_id"]
        transport, key = self.open.get(call_id, (None, None))
        header = request.headers.get("authorization")
        token = bearer_token(header)
        own = key is not None and token is not None \
            and hmac.compare_digest(token.encode(), key.value.encode())
        if not (own or self.access.authorized(header)):
            return CallRefused(401, "invalid_api_key", "missing or invalid API key").response()
        if transport is None:
            return CallRefused(404, "call_not_found", f"no open call {call_id[:64]!r}").response()
        transport.hang_up()
        task = self.tasks.get(call_id)
        if task is not None:  # answered once the session is released
            await asyncio.wait({task}, timeout=self.limits.send_timeout)
        return Response(status_code=204)

    def router(self) -> APIRouter:
        router = APIRouter(prefix=self.prefix)
        router.add_api_route(CALLS_PATH, self.create, methods=["POST"])
        router.add_api_route(CALLS_PATH + "/{call_id}", self.hang_up, methods=["DELETE"])
        router.add_api_route(CALLS_PATH + "/{call_id}/hangup", self.hang_up, methods=["POST"])
        return router
