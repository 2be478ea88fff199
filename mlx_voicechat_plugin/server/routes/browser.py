"""``GET /``: the console page (``static/index.html``), told where the realtime routes are,
and its stylesheet and scripts at ``/static/<name>``. Served at the root, whatever
``--api-prefix``; plain files, no build step, nothing fetched from elsewhere. Event loop."""

from __future__ import annotations

from html import escape
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

STATIC = Path(__file__).resolve().parents[1] / "static"
PAGE = STATIC / "index.html"
# The page's files and their content types (nothing else under static/ is served).
ASSETS = {
    "console.css": "text/css; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "audio.js": "text/javascript; charset=utf-8",
    "transports.js": "text/javascript; charset=utf-8",
    "views.js": "text/javascript; charset=utf-8",
    "dialects.js": "text/javascript; charset=utf-8",
}


def browser_router(api_prefix: str) -> APIRouter:
    router = APIRouter()

    async def browser_page() -> HTMLResponse:
        page = PAGE.read_text(encoding="utf-8")
        return HTMLResponse(page.replace("__API_PREFIX__", escape(api_prefix, quote=True)))

    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return JSONResponse({"error": {"code": "not_found",
                                           "message": f"no such file: {name[:64]}"}}, 404)
        return Response((STATIC / name).read_bytes(), media_type=ASSETS[name],
                        headers={"Cache-Control": "no-cache"})

    router.add_api_route("/", browser_page, methods=["GET"], include_in_schema=False)
    router.add_api_route("/static/{name}", asset, methods=["GET"], include_in_schema=False)
    return router
