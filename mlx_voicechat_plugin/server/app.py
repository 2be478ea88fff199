"""The FastAPI application: the realtime routes of its dialects, ``/v1/audio/transcriptions``,
``GET /health``, ``GET /metrics`` and 501 routes.

Each registered dialect (:data:`.dialects.DIALECTS` by default: mlx-vlm's at
``/v1/realtime``, OpenAI Realtime GA's at ``/openai/v1/realtime``) is served
at its paths; all share the engine's sessions, after the API key, Origin and
``?model=`` checks here. ``/openai/v1`` is one base URL for an OpenAI client:
``realtime``, ``models`` and ``audio/transcriptions`` (the same handler as
``/v1/audio/transcriptions``); ``/v1/models`` lists the model in mlx-vlm's
shape. A browser, which cannot set headers on a WebSocket, may send the key
as the ``openai-insecure-api-key.<KEY>`` subprotocol beside ``realtime``. The
API key is never logged; ``?model=`` is only compared with the served names,
never loaded.

The key is ``api_key`` (``--api-key``) when given; otherwise, as mlx-vlm's
own server does, ``MLX_VLM_SERVER_API_KEY`` read on every request, so a key
set in the environment always guards the server, and an empty one is none.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from starlette.websockets import WebSocketDisconnect, WebSocketState

from .connection import connect
from .dialects import DIALECTS
from .dialects.base import Dialect
from .operations.drain import DEFAULT_DRAIN_SECONDS, Drain
from .engine.thread import Engine
from .limits import ServerLimits
from .options import session_options
from .operations.replica import (
    ReplicaStatus, add_replica_metrics, agent_line, health_response, replica_status,
)
from .messages import Hangup
from .transport.websocket import WebSocketTransport
from .wire import CloseCode

logger = logging.getLogger(__name__)

OPENAI_BASE = "/openai"  # + /v1/...: the OpenAI client's base URL
KEY_SUBPROTOCOL = "openai-insecure-api-key."  # + the API key (OpenAI's browser examples)
REALTIME_SUBPROTOCOL = "realtime"
API_KEY_ENV = "MLX_VLM_SERVER_API_KEY"  # mlx-vlm's key variable, read per request
UNSUPPORTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def served_model_id(model_path: str, alias: str | None = None) -> str:
    """``alias``, else the checkpoint directory's name (a hub id stays as given)."""
    if alias:
        return alias
    path = Path(model_path).expanduser()
    return path.resolve().name if path.exists() else str(model_path)


def normalize_prefix(prefix: str | None) -> str:
    prefix = (prefix or "").strip()
    if not prefix or prefix == "/":
        return ""
    return "/" + prefix.strip("/")


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


def bearer_ok(header: str | None, api_key: str | None) -> bool:
    if not api_key:
        return True
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


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


def model_entry(model_id: str, created: int, openai_shape: bool) -> dict[str, Any]:
    """One ``/models`` entry: OpenAI's (``owned_by``) or mlx-vlm's (``loaded``)."""
    entry: dict[str, Any] = {"id": model_id, "object": "model", "created": created}
    if openai_shape:
        entry["owned_by"] = "mlx-voicechat"
    else:
        entry["loaded"] = True
    return entry


def create_app(
    model_path: str | Path,
    *,
    alias: str | None = None,
    api_key: str | None = None,
    api_prefix: str | None = None,
    allowed_origins: Sequence[str] = (),
    limits: ServerLimits | None = None,
    engine: Engine | None = None,
    warm_up: bool = False,
    api_key_env: str | None = API_KEY_ENV,
    dialects: Sequence[type[Dialect]] = DIALECTS,
    drain_seconds: float = DEFAULT_DRAIN_SECONDS,
    agent_port: int | None = None,
    agent_host: str = "127.0.0.1",
) -> FastAPI:
    """The realtime server for one checkpoint; the engine starts with the app.

    Without ``api_key``, the key is the ``api_key_env`` variable's value at
    each request (none while it is unset or empty). ``dialects`` are served
    at their paths (under ``api_prefix``). ``app.state.drain`` stops it
    gracefully (:mod:`.drain`, within ``drain_seconds``); with ``agent_port``
    it answers HAProxy's agent-check there (:mod:`.agent`; 0: a free port).
    """
    limits = limits or ServerLimits()
    engine = engine or Engine(str(model_path), prompt_cache_bytes=limits.prompt_cache_bytes,
                              warm_up=warm_up, max_sessions=limits.max_sessions,
                              max_state_bytes=limits.max_state_bytes,
                              batch_wait=limits.batch_wait_ms / 1000,
                              batch_fill=limits.batch_fill,
                              session_defaults=session_options(limits, {}))
    model_id = served_model_id(str(model_path), alias)
    # A client may name the model as the server was started with it (the
    # hosts' servers' convention: the path or hub id given), or by its id.
    served_names = tuple(dict.fromkeys((model_id, served_model_id(str(model_path)),
                                        str(model_path))))
    prefix = normalize_prefix(api_prefix)
    origins = tuple(o.rstrip("/") for o in allowed_origins)
    drain = Drain(engine, drain_seconds)

    def status() -> ReplicaStatus:
        """The replica's state now, for /health, the agent-check and /metrics."""
        return replica_status(engine, drain.draining)

    add_replica_metrics(engine.metrics, status)

    def current_key() -> str | None:
        """``--api-key``, else the key variable as it is now (mlx-vlm reads it per request)."""
        return api_key or (os.environ.get(api_key_env) if api_key_env else None) or None

    def authorized(header: str | None) -> bool:
        return bearer_ok(header, current_key())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        drain.attach(asyncio.get_running_loop())
        if agent_port is not None:
            from .operations.agent import CapacityAgent

            app.state.agent = CapacityAgent(lambda: agent_line(status()), agent_host, agent_port)
            await app.state.agent.start()
        try:
            yield
        finally:
            if agent_port is not None:
                await app.state.agent.stop()
            await asyncio.to_thread(engine.stop)

    # No /docs, /redoc or /openapi.json: they would be served without the API
    # key and outside --api-prefix, and describe nothing a client needs.
    app = FastAPI(title="mlx-voicechat realtime", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.limits, app.state.model_id = engine, limits, model_id
    app.state.drain = drain
    if origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(origins),
                           allow_methods=["*"], allow_headers=["*"])

    @app.get(prefix + "/health")
    async def health() -> JSONResponse:
        """The replica's state (:mod:`.replica`): 200 ready, 503 loading or draining, 500 failed."""
        return health_response(status(), model_id, engine, engine.load_error,
                               context_seconds=limits.context_seconds)

    @app.get(prefix + "/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text format; behind the API key when one is set."""
        if not authorized(request.headers.get("authorization")):
            return JSONResponse({"error": {"code": "invalid_api_key",
                                           "message": "missing or invalid API key"}}, 401)
        return Response(engine.metrics.render(), media_type=engine.metrics.content_type)

    @app.get("/", include_in_schema=False)
    async def browser_page() -> Any:
        """The microphone page (static/index.html), told where the realtime route is."""
        from html import escape

        from fastapi.responses import HTMLResponse

        page = (Path(__file__).parent / "static" / "index.html").read_text(encoding="utf-8")
        return HTMLResponse(page.replace("__API_PREFIX__", escape(prefix, quote=True)))

    created = int(time.time())

    def add_models_routes(base: str, openai_shape: bool) -> None:
        """``GET {base}/models`` (a list of the one model) and ``{base}/models/{id}``."""
        async def list_models(request: Request) -> JSONResponse:
            if not authorized(request.headers.get("authorization")):
                return invalid_key()
            return JSONResponse({"object": "list",
                                 "data": [model_entry(model_id, created, openai_shape)]})

        async def retrieve_model(model: str, request: Request) -> JSONResponse:
            if not authorized(request.headers.get("authorization")):
                return invalid_key()
            if model not in served_names:
                return JSONResponse({"error": {
                    "message": f"model {model[:64]!r} is not served here; this server "
                               f"serves {model_id!r}", "type": "invalid_request_error",
                    "param": "model", "code": "model_not_found"}}, 404)
            return JSONResponse(model_entry(model, created, openai_shape))

        app.add_api_route(base + "/models", list_models, methods=["GET"])
        app.add_api_route(base + "/models/{model:path}", retrieve_model, methods=["GET"])

    def invalid_key() -> JSONResponse:
        return JSONResponse({"error": {"code": "invalid_api_key", "type": "invalid_request_error",
                                       "message": "missing or invalid API key"}}, 401)

    add_models_routes(prefix + "/v1", openai_shape=False)
    add_models_routes(prefix + OPENAI_BASE + "/v1", openai_shape=True)

    async def unsupported() -> JSONResponse:
        message = (f"this server runs a speech-to-speech model; connect a WebSocket to "
                   f"{prefix}{dialects[0].paths[0]} instead")
        return JSONResponse({"error": {"code": "not_implemented", "message": message}}, 501)

    for path in UNSUPPORTED_PATHS:
        app.add_api_route(prefix + path, unsupported, methods=["GET", "POST"])

    from .operations.transcriptions import add_transcription_routes

    for base in (prefix, prefix + OPENAI_BASE):  # one handler, mounted under both
        add_transcription_routes(app, engine, base, served_names, limits, authorized,
                                 lambda origin: origin_allowed(origin, origins))

    async def deny(websocket: WebSocket, status: int, message: str) -> None:
        logger.info("rejected upgrade: %s", message)
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            await websocket.send_denial_response(
                JSONResponse({"error": {"code": "invalid_request", "message": message}}, status))
        else:
            await websocket.close(code=CloseCode.POLICY_VIOLATION)

    async def serve(websocket: WebSocket, dialect: type[Dialect]) -> None:
        allowed, subprotocol = websocket_auth(websocket, current_key())
        if not allowed:
            await deny(websocket, 401, "missing or invalid API key")
            return
        if not origin_allowed(websocket.headers.get("origin"), origins):
            await deny(websocket, 403, "origin not allowed")
            return
        asked = websocket.query_params.get("model")
        if asked is not None and asked not in served_names:
            await deny(websocket, 404, f"model {asked[:64]!r} is not served here; this server "
                       f"serves {model_id!r}")
            return
        transport = WebSocketTransport(websocket, limits.max_pending_events,
                                       limits.send_timeout, subprotocol)
        connection = connect(transport, dialect, engine, model_id, limits)
        try:
            await drain.serve(connection)  # connection.run(), ended by a graceful stop
        except (WebSocketDisconnect, Hangup):
            pass
        except Exception as exc:  # e.g. sending after the client went away
            if websocket.client_state == WebSocketState.DISCONNECTED:
                logger.info("%s ended: client gone (%s)", connection.session_id, exc)
            else:
                logger.exception("%s failed", connection.session_id)

    def add_dialect(dialect: type[Dialect]) -> None:
        async def realtime(websocket: WebSocket) -> None:
            await serve(websocket, dialect)

        for path in dialect.paths:
            app.add_api_websocket_route(prefix + path, realtime, name=dialect.name)

    for dialect in dialects:
        add_dialect(dialect)
    return app
