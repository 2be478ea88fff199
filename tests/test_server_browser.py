"""The page at ``/`` talks to ``/v1/realtime`` from a real (headless) Chromium.

Chromium's fake microphone feeds the page; the test drives the page over the
DevTools protocol and counts, on the server side, the audio frames it pushed.
Skipped when no Chromium binary is installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_support import LiveServer
from websockets.sync.client import connect

from mlx_voicechat_plugin.runtime.events import AssistantTextDelta, UserTranscriptDelta
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.dialects.vlm_events import model_event
from mlx_voicechat_plugin.server.engine import Engine
from mlx_voicechat_plugin.server.engine.channel import FrameEvents

PREFIX = "/api"
ALIAS = "browser-voicechat"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
         "--autoplay-policy=no-user-gesture-required", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--remote-debugging-port=0")
TIMEOUT = 60.0
MIN_CHUNKS = 6  # 480 ms of microphone audio before Stop


def find_chromium() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


class CountingEngine(Engine):
    """The real engine, counting the audio the server pushes into it."""

    def __init__(self, model_path: str):
        super().__init__(model_path)
        self.pushed_frames = 0
        self.pushed_samples = 0
        self.peak = 0.0
        self.texts: dict[str, str] = {}  # event type -> the latest full ``text``

    def record(self, events: list) -> list:
        """Runtime events, as the mlx-vlm dialect names them."""
        for event in events:
            if isinstance(event, (AssistantTextDelta, UserTranscriptDelta)):
                payload = model_event(event)
                self.texts[payload["type"]] = payload.get("transcript", payload.get("text"))
        return events

    def append(self, session_id, samples, feed, tag):
        self.pushed_frames += 1  # the page sends one 80 ms chunk a message
        self.pushed_samples += int(samples.shape[0])
        self.peak = max(self.peak, float(np.max(np.abs(samples), initial=0.0)))
        super().append(session_id, samples, feed, tag)

    def open(self, session_id, options, sink):
        engine = self

        class Recording:  # the session's hand-offs, recorded on their way to the connection
            event_loop = sink.event_loop

            def on_handoff(self, handoff):
                for entry in handoff.entries:
                    if isinstance(entry, FrameEvents):
                        engine.record(entry.events)
                sink.on_handoff(handoff)

        return super().open(session_id, options, Recording())

    async def flush(self, session_id, pad_partial=True):
        return self.record(await super().flush(session_id, pad_partial))


class Page:
    """A minimal DevTools-protocol client for one page target."""

    def __init__(self, websocket):
        self.ws = websocket
        self.next_id = 0

    def command(self, method: str, **params) -> dict:
        """One DevTools command's result (its events on the way are skipped)."""
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=TIMEOUT))
            if reply.get("id") == self.next_id:
                assert "error" not in reply, reply
                return reply["result"]

    def evaluate(self, expression: str):
        result = self.command("Runtime.evaluate", expression=expression, returnByValue=True,
                              awaitPromise=True, userGesture=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            assert time.monotonic() < deadline, (expression, self.snapshot())
            time.sleep(0.1)

    def snapshot(self) -> dict:
        return self.evaluate(
            "({state: document.body.dataset.state || null,"
            " status: document.getElementById('status').textContent,"
            " sent: +document.getElementById('sent').textContent,"
            " received: +document.getElementById('received').textContent,"
            " transcript: document.getElementById('transcript').textContent,"
            " assistant: document.getElementById('assistant').textContent})")


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("no chromium binary (apt-get install chromium; `make` does it when CI is set)")
    return path


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    engine = CountingEngine(str(tiny_ckpt))
    live = LiveServer(create_app(tiny_ckpt, alias=ALIAS, api_prefix=PREFIX, engine=engine),
                      wait_ready=False)
    live.wait_health(200, PREFIX + "/health")
    yield live, engine
    live.stop()


@pytest.fixture
def page(chromium, served, tmp_path):
    with browser_page(chromium, served[0], tmp_path / "profile") as client:
        yield client


@contextmanager
def browser_page(chromium: str, live: LiveServer, profile: Path, transport: str = "vlm",
                 flags: tuple[str, ...] = ()):
    """Chromium (with ``flags`` besides :data:`FLAGS`) on the page at ``/`` (its
    ``transport`` chosen), driven over DevTools once the page has loaded."""
    url = live.http(f"/?transport={transport}")
    process = subprocess.Popen([chromium, *FLAGS, *flags, f"--user-data-dir={profile}", url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = devtools_port(profile / "DevToolsActivePort", process)
        target = page_target(port, live.http("/"))
        with connect(target["webSocketDebuggerUrl"], max_size=None,
                     open_timeout=TIMEOUT) as websocket:
            client = Page(websocket)
            client.wait_for("document.readyState === 'complete' && "
                            "document.body.dataset.state === 'idle'")
            yield client
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def devtools_port(path: Path, process: subprocess.Popen) -> int:
    deadline = time.monotonic() + TIMEOUT
    while not (path.exists() and path.read_text().strip()):
        assert process.poll() is None, f"chromium exited with {process.returncode}"
        assert time.monotonic() < deadline, "chromium did not open its DevTools port"
        time.sleep(0.05)
    return int(path.read_text().split()[0])


def page_target(port: int, url: str) -> dict:
    deadline = time.monotonic() + TIMEOUT
    while True:
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=TIMEOUT).json()
        pages = [t for t in targets if t.get("type") == "page" and t.get("url", "").startswith(url)]
        if pages:
            return pages[0]
        assert time.monotonic() < deadline, targets
        time.sleep(0.05)


def test_the_page_is_served_at_the_root_with_the_api_prefix(served):
    live, _ = served
    response = httpx.get(live.http("/"), timeout=TIMEOUT)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert f'<meta name="api-prefix" content="{PREFIX}">' in response.text
    assert "/v1/realtime" in response.text


def test_the_page_streams_the_microphone_and_shows_the_answer(page, served):
    live, engine = served
    frames_before = engine.pushed_frames
    engine.texts.clear()
    page.evaluate("document.getElementById('start').click()")
    ready = page.wait_for("document.body.dataset.state === 'ready' && "
                          "document.getElementById('status').textContent")
    assert ALIAS in ready  # the page shows what the server sent in session.updated
    page.wait_for(f"+document.getElementById('sent').textContent >= {MIN_CHUNKS}")
    deadline = time.monotonic() + TIMEOUT
    # Until the fake microphone's beep (it starts with silence) has reached the model.
    while engine.pushed_frames - frames_before < MIN_CHUNKS or engine.peak == 0.0:
        assert time.monotonic() < deadline, engine.pushed_frames
        time.sleep(0.05)
    page.evaluate("document.getElementById('stop').click()")
    page.wait_for("document.body.dataset.state === 'done' || "
                  "document.body.dataset.state === 'error'")
    page.wait_for("document.getElementById('start').disabled === false")  # socket closed
    seen = page.snapshot()
    live.wait_idle(PREFIX + "/health")

    assert seen["state"] == "done", seen
    frames = engine.pushed_frames - frames_before
    assert frames >= seen["sent"] >= MIN_CHUNKS  # every 80 ms chunk reached the model
    assert engine.peak > 0.0  # the fake microphone's tone, not silence
    assert seen["received"] > 0  # response.audio.delta chunks were played
    assert seen["assistant"]  # the tiny model always says something
    assert seen["assistant"] == engine.texts.get("response.text.delta", "")
    assert seen["transcript"] == engine.texts.get(
        "conversation.item.input_audio_transcription.delta", "")
