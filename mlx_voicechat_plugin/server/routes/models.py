"""The served model: ``GET /v1/models`` in mlx-vlm's shape and ``/openai/v1/models`` in
OpenAI's, and a 501 for what a text model's server would serve. Event loop.

``?model=`` and ``model`` fields are only compared with the served names,
never loaded. The OpenAI Realtime GA route takes any ``?model=`` and reports the
served id (the GA clients' default ``gpt-realtime`` included), as mlx-vlm's server
and most local OpenAI-compatible servers do; with ``--strict-model`` it refuses a
name that is not the served id, the checkpoint's or an ``--alias`` (404).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .access import Access, invalid_key

OPENAI_BASE = "/openai"  # + /v1/...: the OpenAI client's base URL
UNSUPPORTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def served_model_id(model_path: str, alias: str | None = None) -> str:
    """``alias``, else the checkpoint directory's name (a hub id stays as given)."""
    if alias:
        return alias
    path = Path(model_path).expanduser()
    return path.resolve().name if path.exists() else str(model_path)


@dataclass(frozen=True)
class ServedModel:
    """The one model a server serves: its id and every name a client may call it by."""

    model_id: str
    names: tuple[str, ...]
    created: int = field(default_factory=lambda: int(time.time()))
    strict: bool = False  # refuse a model name not in ``names`` on every route

    @classmethod
    def of(cls, model_path: str, alias: str | Sequence[str] | None = None,
           strict: bool = False) -> "ServedModel":
        """A client may name the model as the server was started with it (the hosts'
        servers' convention: the path or hub id given), by its id or by any alias (the
        first alias is the id reported)."""
        aliases = [alias] if isinstance(alias, str) else list(alias or ())
        model_id = served_model_id(model_path, aliases[0] if aliases else None)
        names = (model_id, *aliases, served_model_id(model_path), model_path)
        return cls(model_id, tuple(dict.fromkeys(names)), strict=strict)

    def accepts(self, asked: str | None, any_name: bool = False) -> bool:
        """Whether a session may open for the model ``asked`` (``None``: not said);
        ``any_name``: the route takes any name unless the server is strict."""
        return asked is None or asked in self.names or (any_name and not self.strict)

    def not_served(self, asked: str) -> str:
        """Why ``asked`` is refused (quoted short: a client's text)."""
        return (f"model {asked[:64]!r} is not served here; this server "
                f"serves {self.model_id!r}")

    def entry(self, model_id: str, openai_shape: bool) -> dict[str, Any]:
        """One ``/models`` entry: OpenAI's (``owned_by``) or mlx-vlm's (``loaded``)."""
        entry: dict[str, Any] = {"id": model_id, "object": "model", "created": self.created}
        if openai_shape:
            entry["owned_by"] = "mlx-voicechat"
        else:
            entry["loaded"] = True
        return entry


def models_router(served: ServedModel, access: Access, prefix: str = "") -> APIRouter:
    """``GET {base}/models`` (a list of the one model) and ``{base}/models/{id}``, for mlx-vlm's
    base ``/v1`` and the OpenAI client's ``/openai/v1``."""
    router = APIRouter(prefix=prefix)

    def add(base: str, openai_shape: bool) -> None:
        async def list_models(request: Request) -> JSONResponse:
            if not access.authorized(request.headers.get("authorization")):
                return invalid_key()
            return JSONResponse({"object": "list",
                                 "data": [served.entry(served.model_id, openai_shape)]})

        async def retrieve_model(model: str, request: Request) -> JSONResponse:
            if not access.authorized(request.headers.get("authorization")):
                return invalid_key()
            if model not in served.names:
                return JSONResponse({"error": {
                    "message": served.not_served(model), "type": "invalid_request_error",
                    "param": "model", "code": "model_not_found"}}, 404)
            return JSONResponse(served.entry(model, openai_shape))

        router.add_api_route(base + "/models", list_models, methods=["GET"])
        router.add_api_route(base + "/models/{model:path}", retrieve_model, methods=["GET"])

    add("/v1", openai_shape=False)
    add(OPENAI_BASE + "/v1", openai_shape=True)
    return router


def unsupported_router(realtime_path: str, prefix: str = "") -> APIRouter:
    """501 on a text model's endpoints, pointing at the realtime route instead."""
    router = APIRouter(prefix=prefix)

    async def unsupported() -> JSONResponse:
        message = (f"this server runs a speech-to-speech model; connect a WebSocket to "
                   f"{prefix}{realtime_path} instead")
        return JSONResponse({"error": {"code": "not_implemented", "message": message}}, 501)

    for path in UNSUPPORTED_PATHS:
        router.add_api_route(path, unsupported, methods=["GET", "POST"])
    return router
