"""A WebRTC call's barge-in: what the server still holds of its speech is cut, as OpenAI's
WebRTC server tells it (``output_audio_buffer.started`` / ``.stopped`` / ``.cleared``).

Over a call the server plays the model's audio on its track, paced in real time, so
speech the engine made faster than that waits on the track. ``response.cancel``,
``conversation.item.truncate`` of the item still speaking and the WebRTC-only
``output_audio_buffer.clear`` drop it (the track's queue is read on the server). A real
aiortc client peer (:mod:`rtc_support`) plays the question, commits (push-to-talk), and
the owed response runs on silence as fast as the engine steps, so its speech piles up
on the track. Over the GA WebSocket none of these events exist: the client plays and
drops its own audio. Every ICE candidate is on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from server_support import LiveServer, configure, connect, recv, send

pytest.importorskip("aiortc")
from rtc_support import Caller, question_48k  # noqa: E402
from test_server_webrtc import API_KEY, server  # noqa: E402,F401  (loopback ICE only)

from mlx_voicechat_plugin.server.transport.rtc_media import RATE  # noqa: E402

QUESTION_SECONDS = 1.0
SESSION = {"type": "realtime", "max_response_seconds": 4.0,
           "audio": {"input": {"turn_detection": None}}}
QUEUED_SECONDS = 0.5  # speech waiting on the track before the barge-in
TIMEOUT = 30.0


def playback(events: list[dict]) -> list[tuple[str, str]]:
    return [(e["type"], e.get("response_id")) for e in events
            if e["type"].startswith("output_audio_buffer.")]


async def until(predicate, timeout: float = TIMEOUT) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


async def speaking_call(server: LiveServer, barge_in=None) -> dict:
    """A call: the question, a commit, the owed response's speech piled up on the track;
    then ``barge_in(caller, started_event)`` (``None``: let it play out)."""
    caller = Caller(server.http("/openai/v1"), API_KEY, question_48k(QUESTION_SECONDS))
    try:
        await caller.dial(session=SESSION)
        await caller.until("session.updated")
        caller.microphone.go.set()
        await asyncio.wait_for(caller.microphone.finished.wait(), TIMEOUT)
        caller.send({"type": "input_audio_buffer.commit"})
        started = await caller.until("output_audio_buffer.started")
        track = server.app.state.calls.open[caller.call_id][0].speech
        seen: dict = {"started": started}
        if barge_in is not None:
            await until(lambda: track.queued >= QUEUED_SECONDS * RATE)
            seen["queued"] = track.queued
            spoken = track.spoken
            await barge_in(caller, started)
            await caller.until("output_audio_buffer.cleared")
            seen["queued_after"] = track.queued
            await caller.until("response.done")
            await asyncio.sleep(0.3)
            seen["spoken_after"] = track.spoken - spoken
        else:
            await caller.until("output_audio_buffer.stopped", timeout=60)
            seen["queued_after"] = track.queued
        await caller.quiet(0.5)
        await caller.hang_up()
        seen["events"] = caller.events
        return seen
    finally:
        await caller.close()


def test_speech_played_out_is_started_then_stopped_after_its_response_done(server):
    seen = asyncio.run(speaking_call(server))
    events, response = seen["events"], seen["started"]["response_id"]
    kinds = [e["type"] for e in events]
    assert playback(events) == [("output_audio_buffer.started", response),
                                ("output_audio_buffer.stopped", response)]
    assert kinds.index("output_audio_buffer.started") > kinds.index("response.content_part.added")
    assert kinds.index("output_audio_buffer.stopped") > kinds.index("response.done")
    assert seen["queued_after"] == 0


async def cancel(caller: Caller, started: dict) -> None:
    caller.send({"type": "response.cancel"})


async def clear(caller: Caller, started: dict) -> None:
    caller.send({"type": "response.cancel"})
    caller.send({"type": "output_audio_buffer.clear"})


async def truncate(caller: Caller, started: dict) -> None:
    item = next(e["item"]["id"] for e in caller.events if e["type"] == "response.output_item.added"
                and e["response_id"] == started["response_id"])
    caller.send({"type": "conversation.item.truncate", "item_id": item, "content_index": 0,
                 "audio_end_ms": 200})


@pytest.mark.parametrize("barge_in", [cancel, truncate, clear],
                         ids=["response.cancel", "conversation.item.truncate",
                              "output_audio_buffer.clear"])
def test_a_barge_in_cuts_the_speech_queued_on_the_track(server, barge_in):
    seen = asyncio.run(speaking_call(server, barge_in))
    events, response = seen["events"], seen["started"]["response_id"]
    assert seen["queued"] >= QUEUED_SECONDS * RATE  # speech was waiting on the track ...
    assert seen["queued_after"] == 0  # ... and is gone
    assert seen["spoken_after"] < 0.1 * RATE  # what the track sent after: a frame or so
    cleared = [kind for kind, rid in playback(events) if kind.endswith(".cleared")]
    assert cleared and ("output_audio_buffer.stopped", response) not in playback(events)
    done = next(e for e in events if e["type"] == "response.done")
    assert done["response"]["id"] == response and done["response"]["status"] == "cancelled"
    assert not [e for e in events if e["type"] == "error"]


def test_over_the_websocket_there_is_no_output_audio_buffer(server):
    with connect(server.ws("/openai/v1/realtime"),
                 additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
        configure(ws, **SESSION)
        send(ws, {"type": "output_audio_buffer.clear", "event_id": "e1"})
        error = recv(ws)
    assert error["type"] == "error" and error["error"]["event_id"] == "e1"
    assert "WebRTC" in error["error"]["message"]
