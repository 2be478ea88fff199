"""The FastAPI application: the engine, the drain and one router per concern, wired.

Routes (:mod:`.routes`): the realtime WebSocket routes of the dialects,
``/v1/audio/transcriptions``, ``GET /health`` and ``GET /metrics``, the
models, 501 routes and the browser page, all under ``--api-prefix`` but the
page. ``/openai/v1`` is one base URL for an OpenAI client: ``realtime``,
``models`` and ``audio/transcriptions`` (the same handler as
``/v1/audio/transcriptions``); ``/v1/models`` lists the model in mlx-vlm's
shape. WebRTC calls (``/openai/v1/realtime/calls``, :mod:`.routes.calls`) and
ephemeral keys (``/openai/v1/realtime/client_secrets``) sit beside the GA
WebSocket; GPT-Live's WebSocket and WebRTC sessions share ``/openai/v1/live/sessions``
(:mod:`.routes.live_sessions`). Who may use them: :mod:`.routes.access`.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Sequence

from fastapi import FastAPI

from .dialects.base import Dialect
from .dialects import DIALECTS
from .dialects.client_options import session_options
from .dialects.live.dialect import LiveDialect
from .engine.thread import Engine
from .limits import ServerLimits
from .mcp.config import McpServerSpec
from .mcp.manager import McpManager
from .keys import EphemeralKeys
from .operations.drain import DEFAULT_DRAIN_SECONDS, Drain
from .operations.replica import ReplicaStatus, add_replica_metrics, agent_line, replica_status
from .session.resume import Resumes
from .routes.access import API_KEY_ENV, Access
from .routes.browser import browser_router
from .routes.calls import Calls
from .routes.client_secrets import client_secrets_router
from .routes.live_sessions import LiveSessions
from .routes.models import OPENAI_BASE, ServedModel, models_router, unsupported_router
from .routes.realtime import Realtime, unknown_path_router
from .routes.status import status_router
from .routes.transcriptions import transcriptions_router
from .transport.ice import ICEConfig

logger = logging.getLogger(__name__)

__all__ = ["API_KEY_ENV", "OPENAI_BASE", "create_app", "normalize_prefix"]


def normalize_prefix(prefix: str | None) -> str:
    prefix = (prefix or "").strip()
    if not prefix or prefix == "/":
        return ""
    return "/" + prefix.strip("/")


def create_app(
    model_path: str | Path,
    *,
    alias: str | Sequence[str] | None = None,
    strict_model: bool = False,
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
    ice: ICEConfig | None = None,
    memory_budget: float | None = None,
    mcp_servers: Sequence[McpServerSpec] = (),
    mcp_allow_urls: Sequence[str] = (),
) -> FastAPI:
    """The realtime server for one checkpoint; the engine starts with the app.

    Without ``api_key``, the key is the ``api_key_env`` variable's value at
    each request (none while it is unset or empty). ``dialects`` are served
    at their paths (under ``api_prefix``). ``app.state.drain`` stops it
    gracefully (:mod:`.drain`, within ``drain_seconds``); with ``agent_port``
    it answers HAProxy's agent-check there (:mod:`.agent`; 0: a free port). WebRTC
    calls gather their ICE candidates as ``ice`` says (default: every interface but
    loopback, no STUN or TURN server). ``memory_budget``: the GiB the model and its
    sessions may use (:mod:`..budget`; the device's by default). ``mcp_servers``: the
    operator's MCP servers (``--mcp``), connected at startup, their tools every session's
    (:mod:`.mcp`); ``mcp_allow_urls``: the URL patterns a session may name an MCP server
    by (GA's ``mcp`` tool; none by default).
    """
    limits = limits or ServerLimits()
    engine = engine or Engine(str(model_path), prompt_cache_bytes=limits.prompt_cache_bytes,
                              warm_up=warm_up, max_sessions=limits.max_sessions,
                              max_state_bytes=limits.max_state_bytes,
                              batch_wait=limits.batch_wait_ms / 1000,
                              batch_fill=limits.batch_fill,
                              session_defaults=session_options(limits, {}),
                              memory_budget=memory_budget)
    served = ServedModel.of(str(model_path), alias, strict_model)
    prefix = normalize_prefix(api_prefix)
    access = Access.of(api_key, api_key_env, allowed_origins)
    resumes = Resumes(engine.metrics.registry, limits.max_detached_per_key)
    engine.admission.reclaim_from(resumes)  # a newcomer takes a detached session's slot
    drain = Drain(engine, drain_seconds, resumes=resumes)

    def status() -> ReplicaStatus:
        """The replica's state now, for /health, the agent-check and /metrics."""
        return replica_status(engine, drain.draining)

    add_replica_metrics(engine.metrics, status)
    mcp = McpManager(list(mcp_servers), allow_urls=mcp_allow_urls) \
        if mcp_servers or mcp_allow_urls else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        drain.attach(asyncio.get_running_loop())
        if mcp is not None:
            mcp.start_soon()  # the server is ready meanwhile; tools come as servers connect
        if agent_port is not None:
            from .operations.agent import CapacityAgent

            app.state.agent = CapacityAgent(lambda: agent_line(status()), agent_host, agent_port)
            await app.state.agent.start()
        try:
            yield
        finally:
            if agent_port is not None:
                await app.state.agent.stop()
            await resumes.end_all("the server stopped")
            if mcp is not None:
                await mcp.close()  # stdio children end and are reaped
            await asyncio.to_thread(engine.stop)

    # No /docs, /redoc or /openapi.json: they would be served without the API
    # key and outside --api-prefix, and describe nothing a client needs.
    app = FastAPI(title="mlx-voicechat realtime", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.limits, app.state.model_id = engine, limits, served.model_id
    app.state.drain, app.state.resumes, app.state.mcp = drain, resumes, mcp
    if access.origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(access.origins),
                           allow_methods=["*"], allow_headers=["*"])

    app.include_router(status_router(engine, status, served.model_id, limits.context_seconds,
                                     access, prefix))
    app.include_router(browser_router(prefix))
    app.include_router(models_router(served, access, prefix))
    app.include_router(unsupported_router(dialects[0].paths[0], prefix))
    for base in (prefix, prefix + OPENAI_BASE):  # one handler, mounted under both
        app.include_router(transcriptions_router(engine, served.names, limits, access, base))
    keys = app.state.keys = EphemeralKeys(max_bytes=limits.max_minted_bytes)
    realtime = Realtime(engine, drain, served, limits, access, keys, resumes)
    realtime.mcp = mcp
    app.include_router(realtime.router(dialects, prefix))
    calls = app.state.calls = Calls(engine, drain, served.model_id, limits, access, keys,
                                    ice or ICEConfig(), prefix)
    calls.mcp = mcp
    app.include_router(calls.router())
    if any(issubclass(dialect, LiveDialect) for dialect in dialects):  # its WebRTC sessions
        app.include_router(LiveSessions(engine, drain, served.model_id, limits, access, keys,
                                        ice or ICEConfig(), prefix).router())
    app.include_router(client_secrets_router(keys, access, prefix))
    app.include_router(unknown_path_router([prefix + path for d in dialects for path in d.paths]))
    return app
