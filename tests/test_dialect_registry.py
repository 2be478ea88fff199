"""Adding a dialect is one module plus a line in the list the app serves.

``echo_dialect`` is a third dialect written only against the shared loop, wire
helpers and engine commands; registered beside the two the package speaks, it
is served end to end through a real WebSocket, and nothing else changed.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from echo_dialect import ECHO
from server_support import (
    FRAME, LiveServer, as_received, configure, connect, pcm16, recv, running, send, until_closed,
)
from websockets.exceptions import InvalidStatus

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.dialects import DIALECTS
from mlx_voicechat_plugin.server.engine import load_voicechat
from mlx_voicechat_plugin.testing.fixtures import question_signal

SEED = 3


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from running(LiveServer(create_app(tiny_ckpt, dialects=[*DIALECTS, ECHO])))


def _pcm(samples: np.ndarray) -> str:
    return base64.b64encode(pcm16(samples)).decode("ascii")


def test_a_registered_dialect_streams_the_runtime_events_of_its_session(server, tiny_ckpt):
    audio = question_signal(5 * FRAME / 16_000)
    server.wait_idle()
    with connect(server.ws("/echo/v1/realtime")) as ws:
        assert recv(ws)["type"] == "hello"
        send(ws, {"op": "start", "seed": SEED})
        ready = recv(ws)
        assert ready["type"] == "ready" and ready["frame_samples"] == FRAME
        send(ws, {"op": "audio", "pcm": _pcm(audio[: 2 * FRAME + 100])})
        send(ws, {"op": "audio", "pcm": _pcm(audio[2 * FRAME + 100:])})
        send(ws, {"op": "stop"})
        events, code = until_closed(ws)
    assert code == 1000
    served = [(e["kind"], e["frame"]) for e in events]
    # The same audio through a streaming session of its own, alone.
    stream = load_voicechat(str(tiny_ckpt)).create_streaming_session(seed=SEED)
    alone = [*stream.push_audio(as_received(audio)), *stream.flush()]
    assert served == [(type(e).__name__, int(e.frame_index)) for e in alone]
    assert served[-1][0] == "Done" and ("Audio", 3) in served


def test_its_errors_and_rules_are_its_own(server):
    server.wait_idle()
    with connect(server.ws("/echo/v1/realtime")) as ws:
        recv(ws)
        send(ws, {"op": "audio", "pcm": ""})
        error = recv(ws)
        assert (error["type"], error["code"], error["message"]) == \
            ("oops", "invalid_request", "send start first")
        send(ws, {"op": "start", "seed": -1})
        error = recv(ws)
        assert error["type"] == "oops" and error["code"] == "session_initialization_failed"
        assert error["message"].startswith("seed must be an integer from 0 to 2**64 - 1")


def test_the_packaged_dialects_are_still_served_beside_it(server):
    server.wait_idle()
    with connect(server.ws("/v1/realtime")) as ws:
        configure(ws)
        send(ws, {"type": "session.cancel"})
        events, code = until_closed(ws)
    assert events[-1]["type"] == "response.cancelled" and code == 1000
    server.wait_idle()
    with connect(server.ws("/openai/v1/realtime")) as ws:
        assert recv(ws)["type"] == "session.created"


def test_a_dialect_not_in_the_list_is_not_served(tiny_ckpt):
    live = LiveServer(create_app(tiny_ckpt))
    try:
        with pytest.raises(InvalidStatus):
            with connect(live.ws("/echo/v1/realtime")):
                pass
    finally:
        live.stop()
