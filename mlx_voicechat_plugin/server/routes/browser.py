"""``GET /``: the microphone page (``static/index.html``), told where the realtime route is.
Served at the root, whatever ``--api-prefix``. Event loop."""

from __future__ import annotations

from html import escape
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = Path(__file__).resolve().parents[1] / "static" / "index.html"


def browser_router(api_prefix: str) -> APIRouter:
    router = APIRouter()

    async def browser_page() -> HTMLResponse:
        page = PAGE.read_text(encoding="utf-8")
        return HTMLResponse(page.replace("__API_PREFIX__", escape(api_prefix, quote=True)))

    router.add_api_route("/", browser_page, methods=["GET"], include_in_schema=False)
    return router
