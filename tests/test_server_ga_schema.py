"""Every GA server event, in every path, valid against the openai package's own types.

The Agents SDK validates each event it reads with a ``TypeAdapter`` over the openai
package's ``RealtimeServerEvent`` union and drops (reporting an error) any that fails;
the plain openai client builds its models without validating. So here every event the
GA dialect sends is validated strictly (:mod:`ga_schema`), as it went out: the
conversation book's every path (responses, tools, barge-in, text and audio output,
owed and failed responses, retrieve) through the transport's serializer; a live
WebSocket session (a scripted tool call, errors, every GA client event); a resumed
session (``seq``, ``session.resumed``); a WebRTC call's data channel
(``output_audio_buffer.*``). The last test fails on an event type the dialect's source
can send that no test here checked.
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from ga_schema import CLIENT_EVENT, CLIENT_TYPES, check, emitted_types, every_type_checked
from ga_support import (API_KEY, GA_RATE, MODEL, TOOL, call_frames, question_wav_24k,
                        scripted_call, silence_chunks, wav_chunks)
from raw_client import RawClient
from resume_support import abort, event, reattach, resume_path
from server_support import LiveServer, connect, recv, running, send
from tool_support import RESULT

from mlx_voicechat_plugin.runtime.events import (AssistantTextDelta, Audio, Cancelled, Done,
                                                 ToolCall, TranscriptDone, TurnEnded,
                                                 UserTranscriptDelta)
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.dialects.ga.playback import Playback
from mlx_voicechat_plugin.server.dialects.ga.responses import GAResponses, outgoing
from mlx_voicechat_plugin.server.dialects.ga.config import GAConfig, error_event, session_event
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.messages import AudioMark, AudioOut, JsonOut
from mlx_voicechat_plugin.server.transport.ice import ICEConfig
from mlx_voicechat_plugin.server.transport.websocket import serialize
from mlx_voicechat_plugin.server.wire import ProtocolError

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GA_PATH = f"/openai/v1/realtime?model={MODEL}"
FRAME = 1764  # one frame of the model's 22.05 kHz speech
SEEN: set[str] = set()  # the event types the tests below validated


def wire(messages: list) -> list[dict]:
    """Messages as a WebSocket client reads them (``event_id``, audio as base64)."""
    return [json.loads(serialize(m if not isinstance(m, dict) else JsonOut(m)))
            for m in messages if isinstance(m, (dict, JsonOut, AudioOut))]


def checked(events: list[dict]) -> list[dict]:
    for one in events:
        check(one, SEEN)
    return events


# --- the conversation book, every path -------------------------------------------------


def _audio(frame: int) -> Audio:
    return Audio(frame, np.full(FRAME, 0.1, np.float32), 22_050, np.zeros(31, np.int32))


def _book(modalities: tuple[str, ...], turn_detection: bool = True) -> GAResponses:
    config = GAConfig(output_modalities=modalities)
    if not turn_detection:
        config = GAConfig(output_modalities=modalities, turn_detection=None)
    book = GAResponses(config)
    book.configure(config, 22_050, 0.08)
    return book


@pytest.mark.parametrize("modalities", [("audio",), ("text",)])
def test_every_path_of_the_book_is_valid(modalities):
    book, events = _book(modalities), []
    events += wire([session_event("session.created", "sess_1", MODEL, book.config),
                    error_event("invalid_request", "bad", "evt_1")])
    # The user speaks, pauses (speech_stopped, committed, the item, its transcript).
    events += wire(book.translate([UserTranscriptDelta(0, "hi", "hi")]))
    events += wire(book.translate([_audio(f) for f in range(1, 13)]))
    # The model speaks, ends its turn, the response completes after the tail.
    events += wire(book.translate([AssistantTextDelta(13, 1, "yes", "yes"), _audio(13)]))
    events += wire(book.translate([TurnEnded(14)] + [_audio(f) for f in range(14, 18)]))
    # A tool call mid-utterance, its output, a response.create that waits on an active one.
    events += wire(book.translate([AssistantTextDelta(18, 1, "let", "let"), _audio(18)]))
    events += wire(book.translate([ToolCall(19, "call_abc", "get_weather",
                                            '{"city": "Paris"}')]))
    events += wire(book.item_added({"id": "item_out", "object": "realtime.item",
                                    "type": "function_call_output", "status": "completed",
                                    "call_id": "call_abc", "output": RESULT}))
    events += wire(book.translate([AssistantTextDelta(20, 1, "so", "so"), _audio(20)]))
    events += wire(book.request({"metadata": {"k": "v"}}))
    events += wire(book.cancel())  # the active one cancelled: the waiting one opens
    events += wire(book.fail("the engine failed"))
    events += wire([book.retrieve("item_out")])
    # A bound that ends a response as incomplete; a truncate; a restart; the end.
    events += wire(book.request(None))  # no word comes: it ends at its bound
    events += wire(book.translate([_audio(f) for f in range(21, 21 + 200)]))
    events += wire(book.translate([AssistantTextDelta(222, 1, "b", "b"), _audio(222)]))
    speaking = next(e["item"]["id"] for e in reversed(events)
                    if e["type"] == "response.output_item.added")
    events += wire(book.truncate(speaking))
    events += wire(book.translate([UserTranscriptDelta(223, "so", "hi so")]))
    events += wire(book.restart())
    events += wire(book.translate([AssistantTextDelta(0, 1, "c", "c"), _audio(0),
                                   TranscriptDone(1, ""), Done(1)]))
    checked(events)
    kinds = {e["type"] for e in events}
    assert {"response.done", "conversation.item.retrieved",
            "conversation.item.input_audio_transcription.completed"} <= kinds
    statuses = {e["response"]["status"] for e in events if e["type"] == "response.done"}
    assert statuses == {"completed", "cancelled", "failed", "incomplete"}


def test_push_to_talk_and_a_cancelled_stream_are_valid():
    book, events = _book(("audio",), turn_detection=False), []
    events += wire(book.translate([UserTranscriptDelta(0, "hi", "hi"), _audio(0)]))
    events += wire(book.commit())  # the item committed; a response owed
    events += wire(book.translate([AssistantTextDelta(1, 1, "ok", "ok"), _audio(1)]))
    events += wire(book.translate([Cancelled(2)]))
    events += wire(book.commit())  # nothing said: committed, no item
    checked(events)


def test_a_call_the_server_runs_is_a_valid_mcp_call_item():
    from mlx_voicechat_plugin.server.mcp.events import ServerToolCall, ToolOutput

    book, events = _book(("audio",)), []
    events += wire(book.translate([AssistantTextDelta(1, 1, "let", "let"), _audio(1)]))
    events += wire(book.translate([ServerToolCall(2, "call_a", "get_weather",
                                                  '{"city": "Paris"}', server_label="tools")]))
    events += wire(book.translate([ToolOutput(3, "call_a", "get_weather", "tools",
                                              '{"city": "Paris"}', '{"temp": 21}')]))
    events += wire(book.translate([ServerToolCall(4, "call_b", "slow", "{}",
                                                  server_label="tools")]))
    events += wire(book.translate([ToolOutput(5, "call_b", "slow", "tools", "{}",
                                              '{"error": {}}', "timeout", "no answer in 2 s")]))
    events += wire(book.translate([AssistantTextDelta(6, 1, "so", "so"), _audio(6),
                                   TurnEnded(7)] + [_audio(f) for f in range(7, 11)]))
    checked(events)
    kinds = [e["type"] for e in events]
    assert kinds.count("response.mcp_call.completed") == kinds.count("response.mcp_call.failed")
    done = [e["item"] for e in events if e["type"] == "conversation.item.done"
            and e["item"]["type"] == "mcp_call"]
    assert done[0]["output"] == '{"temp": 21}' and done[1]["error"]["message"].startswith(
        "timeout: ")
    (response,) = [e["response"] for e in events if e["type"] == "response.done"]
    assert [i["type"] for i in response["output"]].count("mcp_call") == 2


def test_a_session_mcp_servers_listing_and_approval_are_valid():
    from mlx_voicechat_plugin.server.dialects.ga import mcp_tools
    from mlx_voicechat_plugin.server.mcp.events import ApprovalRequest
    from mlx_voicechat_plugin.server.mcp.session_servers import SessionMcpServer

    book, events = _book(("audio",)), []
    server = SessionMcpServer("web", "https://mcp.example.com/mcp")
    item_id, out = mcp_tools.listing_started(book, server)
    events += wire(out)
    events += wire(mcp_tools.listing_done(book, item_id, server, {
        "get_weather": {"description": "Weather.", "inputSchema": {"type": "object"}}}))
    failed_id, out = mcp_tools.listing_started(book, server)
    events += wire(out + [{"type": "mcp_list_tools.failed", "item_id": failed_id}])
    out = []
    mcp_tools.approval_request(book, ApprovalRequest(3, "mcpr_1", "call_1", "get_weather",
                                                     "web", "{}"), out)
    events += wire(out)
    echoed, request_id, approve = mcp_tools.approval_response(
        {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": False})
    events += wire(book.item_added(echoed))
    checked(events)
    assert (request_id, approve) == ("mcpr_1", False)


def test_the_transcription_usage_is_the_audio_transcribed():
    """``usage.seconds``: the frames heard since the previous commit (80 ms each)."""
    book = _book(("audio",), turn_detection=False)
    book.translate([_audio(f) for f in range(0, 5)])
    book.translate([UserTranscriptDelta(5, "hi", "hi")] + [_audio(f) for f in range(5, 10)])
    first = [e for e in wire(book.commit())
             if e["type"] == "conversation.item.input_audio_transcription.completed"]
    book.translate([UserTranscriptDelta(10, "so", "hi so")] + [_audio(f) for f in range(10, 13)])
    second = [e for e in wire(book.commit())
              if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert [e["usage"] for e in first + second] == [
        {"type": "duration", "seconds": 0.8}, {"type": "duration", "seconds": 0.24}]
    checked(first + second)


def test_playback_on_a_track_is_valid():
    """What a WebRTC call's data channel adds: ``output_audio_buffer.*``."""
    book, playback = _book(("audio",)), Playback(lambda: True)
    assert wire(playback.clear(asked=True)) == []  # nothing has played: no response named
    out = playback.follow(book.translate([AssistantTextDelta(0, 1, "a", "a"), _audio(0)]))
    out += playback.follow(outgoing(book.cancel()))
    marks = [m for m in out if isinstance(m, AudioMark)]
    out += playback.played(marks[0]) + playback.clear(asked=True)
    kinds = [e["type"] for e in checked(wire(out))]
    assert {"output_audio_buffer.started", "output_audio_buffer.stopped",
            "output_audio_buffer.cleared"} <= set(kinds)


def test_retrieve_of_an_unknown_or_deleted_item_is_openais_error():
    book = _book(("audio",))
    book.item_added({"id": "item_1", "object": "realtime.item", "type": "message",
                     "status": "completed", "role": "user", "content": []})
    assert book.retrieve("item_1")["item"]["id"] == "item_1"
    checked(wire([book.delete("item_1")]))
    for item_id in ("item_nope", "item_1"):
        with pytest.raises(ProtocolError) as refused:
            book.retrieve(item_id)
        assert refused.value.code == "item_retrieve_invalid_item_id"
        assert f"the item with id {item_id!r} does not exist" in refused.value.message


# --- live: a WebSocket session, a resumed one, a WebRTC call ---------------------------


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    from rtc_support import LOOPBACK

    limits = ServerLimits(update_timeout=10, idle_timeout=60)
    app = create_app(tiny_ckpt, api_key=API_KEY, limits=limits, ice=ICEConfig(hosts=LOOPBACK))
    yield from running(LiveServer(app))


@pytest.fixture(scope="module")
def resumable(tiny_ckpt):
    limits = ServerLimits(update_timeout=10, idle_timeout=10, resume_seconds=10)
    yield from running(LiveServer(create_app(tiny_ckpt, api_key=API_KEY, limits=limits)))


def _until(ws, kind: str, events: list[dict]) -> dict:
    while True:
        one = recv(ws)
        check(one, SEEN)
        events.append(one)
        if one["type"] == kind:
            return one


def test_a_tool_conversation_over_a_websocket_is_valid(server, monkeypatch, tmp_path):
    script = scripted_call(server, monkeypatch)
    wav = question_wav_24k(tmp_path / "q.wav", call_frames(script) * 0.08 + 0.5)
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as ws:
        _until(ws, "session.created", events)
        send(ws, {"type": "session.update", "session": {"type": "realtime", "tools": [TOOL],
                                                        "instructions": "Be brief."}})
        _until(ws, "session.updated", events)
        for chunk in wav_chunks(wav):
            send(ws, {"type": "input_audio_buffer.append",
                      "audio": base64.b64encode(chunk).decode()})
        call = _until(ws, "response.function_call_arguments.done", events)
        send(ws, {"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": call["call_id"], "output": RESULT}})
        _until(ws, "conversation.item.done", events)
        send(ws, {"type": "conversation.item.retrieve", "item_id": call["item_id"]})
        retrieved = _until(ws, "conversation.item.retrieved", events)
        assert retrieved["item"]["call_id"] == call["call_id"]
        send(ws, {"type": "conversation.item.retrieve", "item_id": "item_nope",
                  "event_id": "evt_r"})
        error = _until(ws, "error", events)["error"]
        assert (error["code"], error["event_id"]) == ("item_retrieve_invalid_item_id", "evt_r")
        for chunk in silence_chunks(0.5):
            send(ws, {"type": "input_audio_buffer.append",
                      "audio": base64.b64encode(chunk).decode()})
        send(ws, {"type": "input_audio_buffer.commit"})
        _until(ws, "input_audio_buffer.committed", events)
    assert any(e["type"] == "response.output_audio.delta" for e in events)


def _message(text: str) -> dict:
    return {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}]}


def test_a_truncate_of_an_unknown_item_is_openais_error(server):
    server.wait_idle()
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as ws:
        _until(ws, "session.created", [])
        send(ws, {"type": "conversation.item.truncate", "item_id": "item_nope",
                  "content_index": 0, "audio_end_ms": 0, "event_id": "evt_t"})
        error = _until(ws, "error", [])["error"]
    assert (error["code"], error["event_id"]) == ("item_truncate_invalid_item_id", "evt_t")
    assert "the item with id 'item_nope' does not exist" in error["message"]


# One valid event of each GA client event type, and the event type that answers it
# (``error``: refused as OpenAI's server refuses it over a WebSocket).
CLIENT_CASES = {
    "session.update": ({"session": {"type": "realtime", "max_response_seconds": 5.0}},
                       "session.updated"),
    "input_audio_buffer.append": ({"audio": base64.b64encode(bytes(4800)).decode()}, None),
    "input_audio_buffer.commit": ({}, "input_audio_buffer.committed"),
    "input_audio_buffer.clear": ({}, "input_audio_buffer.cleared"),
    "conversation.item.create": ({"item": {"id": "item_u1", **_message("hi")}},
                                 "conversation.item.done"),
    "conversation.item.retrieve": ({"item_id": "item_u1"}, "conversation.item.retrieved"),
    "conversation.item.truncate": ({"item_id": "item_u1", "content_index": 0,
                                    "audio_end_ms": 0}, "conversation.item.truncated"),
    "conversation.item.delete": ({"item_id": "item_u1"}, "conversation.item.deleted"),
    "response.create": ({"response": {"metadata": {"k": "v"}}}, "response.created"),
    "response.cancel": ({}, "response.done"),
    # WebRTC only: the server plays the audio there; a WebSocket client drops its own.
    "output_audio_buffer.clear": ({}, "error"),
}


def test_every_ga_client_event_is_answered(server):
    """Each type of the openai package's client-event union, valid by its types, is
    answered (or refused as OpenAI refuses it), never an unsupported event type."""
    assert set(CLIENT_CASES) == CLIENT_TYPES, "a GA client event without a case here"
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as ws:
        _until(ws, "session.created", events)
        for kind, (fields, answer) in CLIENT_CASES.items():
            message = {"type": kind, "event_id": f"evt_{kind}", **fields}
            CLIENT_EVENT.validate_python(message, strict=True)
            send(ws, message)
            if answer is None:
                continue
            got = _until(ws, answer, events)
            errors = [e["error"] for e in events if e["type"] == "error"]
            if answer == "error":  # refused, naming the client event, as OpenAI does
                assert got["error"]["event_id"] == f"evt_{kind}"
                assert "unsupported" not in got["error"]["message"], got
            else:
                assert not errors, (kind, errors)
            events.clear()


BAD_UPDATES = [
    {"instructions": 5},
    {"tools": [{"type": "function", "name": 3}]},
    {"audio": {"input": {"transcription": "yes"}}},
    {"audio": {"input": {"turn_detection": {"type": "nope"}}}},
    {"audio": {"input": {"turn_detection": {"silence_duration_ms": "x"}}}},
    {"audio": {"input": {"turn_detection": {"create_response": "yes"}}}},
    {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "x"}}}},
]


@pytest.mark.parametrize("update", BAD_UPDATES)
def test_a_session_update_the_session_object_could_not_echo_is_refused(server, update):
    """The session object echoes what the client sent: a field its GA type would
    reject is an error naming the field, and the session lives on."""
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as ws:
        _until(ws, "session.created", events)
        send(ws, {"type": "session.update", "session": {"type": "realtime", **update}})
        error = recv(ws)
        check(error, SEEN)
        assert error["type"] == "error", error
        send(ws, {"type": "session.update", "session": {"type": "realtime"}})
        _until(ws, "session.updated", events)


def test_a_resumed_session_is_valid(resumable):
    """``seq`` on every event, the replay and ``session.resumed`` (our extension)."""
    resumable.wait_idle()
    path = "/openai/v1/realtime"
    client = RawClient(resumable.port, path, headers=AUTH)
    created = checked([event(client)])[0]
    client.send_json({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": None}}}})
    updated = checked([event(client)])[0]
    client.send_json({"type": "input_audio_buffer.append",
                      "audio": base64.b64encode(bytes(2 * 3840)).decode()})
    client.send_json({"type": "input_audio_buffer.commit"})
    abort(client)
    again = reattach(resumable.port, resume_path(path, created["session"]["resume_token"],
                                                 updated["seq"]), headers=AUTH)
    resumed = checked([event(again)])[0]
    assert resumed["type"] == "session.resumed"
    replayed = checked([event(again) for _ in range(resumed["replayed"])])
    assert all("seq" in e for e in replayed)
    again.send_frame(b"\x03\xe8", opcode=0x8)  # a clean close: the session ends
    again.close()
    resumable.wait_idle()


def test_a_webrtc_calls_data_channel_is_valid(server):
    pytest.importorskip("aiortc")
    from rtc_support import Caller, question_48k

    async def call() -> list[dict]:
        caller = Caller(server.http("/openai/v1"), API_KEY, question_48k(1.0))
        try:
            await caller.dial(session={"type": "realtime", "max_response_seconds": 1.0,
                                       "audio": {"input": {"turn_detection": None}}})
            await caller.until("session.updated")
            caller.microphone.go.set()
            await asyncio.wait_for(caller.microphone.finished.wait(), 30)
            caller.send({"type": "input_audio_buffer.commit"})
            await caller.until("response.done", timeout=30)
            caller.send({"type": "output_audio_buffer.clear"})
            await caller.until("output_audio_buffer.cleared")
            await caller.quiet(0.5)
            await caller.hang_up()
            return caller.events
        finally:
            await caller.close()

    server.wait_idle()
    events = checked(asyncio.run(call()))
    assert any(e["type"] == "output_audio_buffer.cleared" for e in events)
    assert not any(e["type"] == "response.output_audio.delta" for e in events)  # on the track


def test_every_event_type_the_dialect_sends_was_checked(request):
    """The GA event types in the dialect's source (:func:`ga_schema.emitted_types`), each
    validated by a test above."""
    every_type_checked(request, emitted_types(), SEEN, "GA")
