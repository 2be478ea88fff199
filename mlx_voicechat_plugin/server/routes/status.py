"""``GET /health`` (the replica's state, :mod:`..operations.replica`) and ``GET /metrics``
(Prometheus text format, behind the API key when one is set). Event loop."""

from __future__ import annotations

from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine.thread import Engine
from ..operations.replica import ReplicaStatus, health_response
from .access import Access


def status_router(engine: Engine, status: Callable[[], ReplicaStatus], model_id: str,
                  context_seconds: float | None, access: Access, prefix: str = "") -> APIRouter:
    """``status`` is the replica's state now (the same the agent-check answers)."""
    router = APIRouter(prefix=prefix)

    async def health() -> JSONResponse:
        """The replica's state: 200 ready, 503 loading or draining, 500 failed."""
        return health_response(status(), model_id, engine, engine.load_error,
                               context_seconds=context_seconds)

    async def metrics(request: Request) -> Response:
        if not access.authorized(request.headers.get("authorization")):
            return JSONResponse({"error": {"code": "invalid_api_key",
                                           "message": "missing or invalid API key"}}, 401)
        return Response(engine.metrics.render(), media_type=engine.metrics.content_type)

    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/metrics", metrics, methods=["GET"])
    return router
