"""While the server owes a GA client a response, the timeline runs and the idle rule waits.

A raw WebSocket, a slowed engine (each frame takes a while) and the model's
end-of-turn token ignored: the owed response then runs to its bound, several
idle timeouts long, and must still end with ``response.done``.
"""

from __future__ import annotations

import asyncio

import pytest
from ga_support import API_KEY, MODEL
from server_support import LiveServer, connect, recv, running, send

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.dialects.ga.responses import GAResponses
from mlx_voicechat_plugin.server.engine import Engine
from mlx_voicechat_plugin.server.limits import ServerLimits

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GA_PATH = f"/openai/v1/realtime?model={MODEL}"
IDLE_SECONDS = 0.5
FRAME_DELAY = 0.05  # per pushed frame: 25 frames of a 2 s bound take 2.5 idle timeouts


class SlowEngine(Engine):
    def __init__(self, model_path: str):
        super().__init__(model_path)
        self.pushes = 0

    async def push(self, session_id, samples):
        self.pushes += 1
        await asyncio.sleep(FRAME_DELAY)
        return await super().push(session_id, samples)


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=5, idle_timeout=IDLE_SECONDS)
    engine = SlowEngine(str(tiny_ckpt))
    yield from running(LiveServer(create_app(tiny_ckpt, api_key=API_KEY, limits=limits,
                                             engine=engine)))


@pytest.fixture
def ws(server, monkeypatch):
    monkeypatch.setattr(GAResponses, "_turn_ended", lambda self, frame: None)
    server.wait_idle()
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as client:
        assert recv(client)["type"] == "session.created"
        send(client, {"type": "session.update", "session": {
            "type": "realtime", "max_response_seconds": 2.0,
            "audio": {"input": {"turn_detection": None}}}})
        assert recv(client)["type"] == "session.updated"
        yield client


def _until(ws, kind: str) -> list[dict]:
    events = []
    while (event := recv(ws))["type"] != kind:
        events.append(event)
    return events + [event]


def test_a_commit_owes_a_response_that_ends_at_its_bound_without_an_idle_close(server, ws):
    before = server.app.state.engine.pushes
    send(ws, {"type": "input_audio_buffer.commit"})
    events = _until(ws, "response.done")
    assert not [e for e in events if e["type"] == "error"], events
    done = events[-1]["response"]
    assert done["status"] == "incomplete"  # the model kept talking: cut at the bound
    assert done["status_details"]["reason"] == "max_output_tokens"
    pushed = server.app.state.engine.pushes - before
    assert pushed * FRAME_DELAY > 2 * IDLE_SECONDS  # the server ran silence for that long
    assert done["usage"]["input_tokens"] <= pushed
    # and once nothing is owed, the idle rule applies again
    error = _until(ws, "error")[-1]["error"]
    assert "idle" in error["message"]


def test_response_cancel_ends_the_owed_response_and_the_silence(server, ws):
    send(ws, {"type": "response.create"})
    created = recv(ws)
    assert created["type"] == "response.created"
    send(ws, {"type": "response.cancel"})
    events = _until(ws, "response.done")
    assert events[-1]["response"]["id"] == created["response"]["id"]
    assert events[-1]["response"]["status"] == "cancelled"
    pushes = server.app.state.engine.pushes
    send(ws, {"type": "conversation.item.delete", "item_id": "item_x"})
    _until(ws, "conversation.item.deleted")
    assert server.app.state.engine.pushes == pushes  # nothing owed: no more silence


def test_truncating_the_spoken_item_ends_its_response(server, ws):
    send(ws, {"type": "response.create"})
    events = _until(ws, "response.output_item.added")
    item_id = events[-1]["item"]["id"]
    send(ws, {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
              "audio_end_ms": 80})
    events = _until(ws, "conversation.item.truncated")
    done = [e for e in events if e["type"] == "response.done"]
    assert len(done) == 1 and done[0]["response"]["status"] in ("cancelled", "incomplete")
