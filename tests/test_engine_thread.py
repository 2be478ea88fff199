"""The engine thread runs the model only: no JSON and no base64 on it, in either dialect.

The engine hands each session's runtime events to its connection, and the
connection's dialect serializes them on the event loop. Every ``json.dumps``
and ``base64.b64encode`` call is recorded with the thread that made it while
an mlx-vlm and a GA client stream audio and commit.
"""

from __future__ import annotations

import base64
import json
import threading

import numpy as np
import pytest
from server_support import (
    FRAME, LiveServer, append_message, configure, connect, recv, running, send, until_closed,
)

from mlx_voicechat_plugin.server.app import create_app

ENGINE_THREAD = "mlx-voicechat-engine"


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from running(LiveServer(create_app(tiny_ckpt)))


@pytest.fixture
def threads(monkeypatch):
    """Names of the threads that serialized JSON or encoded base64, by function."""
    seen: dict[str, set[str]] = {"dumps": set(), "b64encode": set()}

    def recording(module, name):
        original = getattr(module, name)

        def call(*args, **kwargs):
            seen[name].add(threading.current_thread().name)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    recording(json, "dumps")
    recording(base64, "b64encode")
    return seen


def test_mlx_vlm_events_are_serialized_off_the_engine_thread(server, threads):
    server.wait_idle()
    with connect(server.ws()) as ws:
        configure(ws)
        send(ws, append_message(np.zeros(3 * FRAME + 100, np.float32)))
        send(ws, {"type": "input_audio_buffer.commit"})
        events, code = until_closed(ws)
    assert code == 1000 and any(e["type"] == "response.audio.delta" for e in events)
    assert threads["dumps"] and threads["b64encode"]  # the events were serialized ...
    assert ENGINE_THREAD not in threads["dumps"] | threads["b64encode"]  # ... elsewhere


def test_ga_events_and_audio_are_encoded_off_the_engine_thread(server, threads):
    server.wait_idle()
    with connect(server.ws("/openai/v1/realtime")) as ws:
        assert recv(ws)["type"] == "session.created"
        send(ws, {"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"turn_detection": None}}}})
        assert recv(ws)["type"] == "session.updated"
        pcm = base64.b64encode(np.zeros(24_000 // 2, "<i2").tobytes()).decode("ascii")
        send(ws, {"type": "input_audio_buffer.append", "audio": pcm})
        send(ws, {"type": "input_audio_buffer.commit"})
        kinds = []
        while (event := recv(ws))["type"] != "response.done":
            kinds.append(event["type"])
    assert "input_audio_buffer.committed" in kinds
    assert threads["dumps"]
    assert ENGINE_THREAD not in threads["dumps"] | threads["b64encode"]
