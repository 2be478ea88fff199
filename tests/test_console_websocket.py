"""The console's fallback: the same page over the GA WebSocket, from a real (headless) Chromium.

The driver (``console_driver.py``) runs as for WebRTC, in a loopback-only network
namespace, with ``--transport websocket``: the page streams the fake microphone as
base64 PCM16 ``input_audio_buffer.append`` events and plays the audio deltas. The
page sends the key it was given as the WebSocket's key subprotocol. Skipped where the
WebRTC console test skips.
"""

from __future__ import annotations

import json

import pytest
from test_console_webrtc import drive_console


@pytest.fixture(scope="module")
def websocket_run(tiny_ckpt, tmp_path_factory) -> dict:
    return drive_console(tiny_ckpt, tmp_path_factory.mktemp("console-ws"), "websocket")[0]


def test_the_page_talks_over_the_websocket_and_shows_both_sides(websocket_run):
    seen = websocket_run
    assert seen["state"] == "ready", seen
    assert seen["errors"] == [], seen["errors"]
    assert seen["transcript"] and seen["assistant"]
    assert seen["peak"] > 0  # the audio deltas reached the output meter


def test_the_tool_call_is_answered_over_the_websocket(websocket_run):
    (call,) = websocket_run["calls"]
    assert json.loads(call["args"]) == {"city": "Paris"}
    assert '"forecast":"sunny"' in call["ack"]


def test_finish_over_the_websocket_releases_the_session(websocket_run):
    after = websocket_run["after_finish"]
    assert after["state"] == "done" and after["errors"] == [], after
    assert websocket_run["released"]
