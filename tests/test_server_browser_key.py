"""The page at ``/`` connects to a server started with ``--api-key`` (headless Chromium).

A browser cannot set ``Authorization`` on a WebSocket: the page sends the key
from its key field as the ``openai-insecure-api-key.<KEY>`` subprotocol beside
``realtime``, as OpenAI's browser examples do. Skipped without Chromium.
"""

from __future__ import annotations

import pytest
from server_support import LiveServer
from test_server_browser import (  # noqa: F401  (chromium is a fixture)
    MIN_CHUNKS,
    CountingEngine,
    browser_page,
    chromium,
)

from mlx_voicechat_plugin.server.app import create_app

KEY = "browser-key-123"


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    engine = CountingEngine(str(tiny_ckpt))
    live = LiveServer(create_app(tiny_ckpt, api_key=KEY, engine=engine), wait_ready=False)
    live.wait_health(200)
    yield live, engine
    live.stop()


@pytest.fixture
def page(chromium, served, tmp_path):  # noqa: F811
    with browser_page(chromium, served[0], tmp_path / "profile") as client:
        yield client


def _talk(page) -> dict:
    page.evaluate("document.getElementById('start').click()")
    page.wait_for("['ready', 'closed', 'error'].includes(document.body.dataset.state)")
    if page.snapshot()["state"] != "ready":
        return page.snapshot()
    page.wait_for(f"+document.getElementById('sent').textContent >= {MIN_CHUNKS}")
    page.evaluate("document.getElementById('stop').click()")
    page.wait_for("document.getElementById('start').disabled === false")  # socket closed
    return page.snapshot()


def test_the_page_connects_with_the_key_from_its_field(page, served):
    live, engine = served
    page.evaluate(f"document.getElementById('key').value = {KEY!r}")
    seen = _talk(page)
    live.wait_idle()
    assert seen["state"] == "done", seen
    assert seen["received"] > 0 and seen["assistant"]


def test_the_page_without_the_key_is_refused(page, served):
    live, _ = served
    page.evaluate("document.getElementById('key').value = 'wrong'")
    seen = _talk(page)
    assert seen["state"] == "closed", seen
    assert seen["sent"] == 0
