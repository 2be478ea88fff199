"""The console's files: served at ``/static/<name>`` with their content types, shipped
with the package, and self-contained (the page works on a machine with no internet)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from mlx_voicechat_plugin.server.routes.browser import ASSETS, STATIC, browser_router

ROOT = Path(__file__).resolve().parents[1]
# A URL the browser would fetch from elsewhere (a CDN, a font, an analytics script).
REMOTE = re.compile(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|import\s[^;]*["'](?:https?:)?//"""
                    r"""|@import\s+url\(\s*["']?(?:https?:)?//|fetch\(\s*["'](?:https?:)?//""")


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    app.include_router(browser_router("/api"))
    return TestClient(app)


def test_every_file_of_the_page_is_served_with_its_content_type(client):
    for name, kind in ASSETS.items():
        response = client.get(f"/static/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"] == kind
        assert response.content == (STATIC / name).read_bytes()


def test_the_page_names_only_files_that_are_served(client):
    page = client.get("/").text
    named = set(re.findall(r'(?:src|href)="static/([^"]+)"', page))
    for script in ASSETS:
        if script.endswith(".js"):
            named |= set(re.findall(r'from "\./([^"]+)"', (STATIC / script).read_text()))
    assert named == set(ASSETS)  # each module it loads is served, and nothing else is


def test_nothing_else_under_static_is_served(client):
    assert client.get("/static/index.html").status_code == 404
    assert client.get("/static/..%2Fapp.py").status_code == 404


def test_the_page_loads_nothing_from_elsewhere():
    for path in STATIC.iterdir():
        assert not REMOTE.search(path.read_text(encoding="utf-8")), path.name


def test_the_package_ships_the_page_files():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["mlx_voicechat_plugin.server"]
    for path in STATIC.iterdir():
        assert any(path.match(pattern) for pattern in patterns), path.name
