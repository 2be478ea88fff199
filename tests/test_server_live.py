"""OpenAI's GPT-Live protocol at ``/openai/v1/live/sessions``, driven by the openai SDK's own
live client (``client.live.connect()``) through real sockets, every event it reads
validated strictly against ``openai.types.live.ServerEvent`` (:mod:`live_schema`).

A conversation: ``session.start`` with a Responses delegation's function tool, audio in,
both transcripts and audio out, a delegated call (a scripted ``get_weather`` on the
function channel) and its result, a mute, a close with its reason. Then bad input as
OpenAI answers it, each followed by a request that works; every client event type
answered; the last test fails on an event type the dialect sends that no test checked.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path

import pytest
from ga_support import (API_KEY, MODEL, TOOL, base_url, call_frames, scripted_call,
                        scripted_question, silence_chunks, wav_chunks)
from server_support import LiveServer, connect, recv, running, send
from tool_support import RESULT, short_tool_prompt

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.dialects.live.dialect import MAX_APPEND_SECONDS
from mlx_voicechat_plugin.server.limits import ServerLimits

openai = pytest.importorskip("openai")
from ga_schema import every_type_checked  # noqa: E402
from live_schema import CLIENT_EVENT, CLIENT_TYPES, check, emitted_types  # noqa: E402

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PATH = "/openai/v1/live/sessions"
SEEN: set[str] = set()  # the event types the tests below validated
SESSION = {
    "model": "gpt-live-1",
    "instructions": "Be brief.",
    "audio": {"format": {"type": "audio/pcm", "rate": 24000},
              "output": {"voice": "marin"}},
    "delegation": {"type": "responses",
                   "responses": {"model": "gpt-5.5", "tools": [TOOL],
                                 "tool_choice": "auto"}},
}


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    from mlx_voicechat_plugin.server.transport.ice import ICEConfig

    limits = ServerLimits(update_timeout=10, idle_timeout=10)
    app = create_app(tiny_ckpt, api_key=API_KEY, limits=limits,
                     ice=ICEConfig(hosts=("127.0.0.1",)))
    yield from running(LiveServer(app))


async def _until(connection, kind: str, events: list, timeout: float = 30.0, where=None):
    """Receive (each event validated, kept) until one of type ``kind`` (and ``where``)."""
    async def wait():
        while True:
            event = json.loads(await connection.recv_bytes())
            check(event, SEEN)
            events.append(event)
            if event["type"] == kind and (where is None or where(event)):
                return event
    return await asyncio.wait_for(wait(), timeout)


async def _send_audio(connection, chunks) -> None:
    for chunk in chunks:
        await connection.session.input_audio.append(audio=base64.b64encode(chunk).decode())


def _nested(kind: str):
    return lambda e: e["event"]["type"] == kind


async def _conversation(server, wav) -> dict:
    events: list = []
    client = openai.AsyncOpenAI(api_key=API_KEY, base_url=base_url(server))
    async with client.live.connect() as connection:
        await connection.session.start(session=SESSION, event_id="evt_start")
        started = await _until(connection, "session.started", events)
        sender = asyncio.ensure_future(_send_audio(connection, wav_chunks(wav)))
        delegated = await _until(connection, "session.delegation.created", events)
        call = await _until(connection, "response.event", events,
                            where=_nested("response.function_call_arguments.done"))
        item = await _until(connection, "response.event", events,
                            where=_nested("response.output_item.done"))
        await sender
        await connection.response.item.create(item={
            "type": "function_call_output", "call_id": item["event"]["item"]["call_id"],
            "output": RESULT})
        await connection.response.create()
        continued = await _until(connection, "response.event", events,
                                 where=_nested("response.completed"))
        await connection.session.input_audio.mute(event_id="evt_mute")
        muted = await _until(connection, "session.input_audio.muted", events)
        await _send_audio(connection, silence_chunks(0.5))
        await connection.session.input_audio.unmute()
        await _until(connection, "session.input_audio.unmuted", events)
        await _send_audio(connection, silence_chunks(1.0))
        await connection.session.close(event_id="evt_close")
        closed = await _until(connection, "session.closed", events)
    return {"started": started, "delegated": delegated, "call": call, "item": item,
            "continued": continued, "muted": muted, "closed": closed, "events": events,
            "sdk": [connection.parse_event(json.dumps(e)) for e in events]}


@pytest.fixture(scope="module")
def conversation(server, tmp_path_factory):
    with scripted_question(server, tmp_path_factory, "live") as (_, wav):
        return asyncio.run(_conversation(server, wav))


def _of(conversation, kind: str) -> list[dict]:
    return [e for e in conversation["events"] if e["type"] == kind]


def test_session_started_has_the_resolved_config(conversation):
    started = conversation["started"]
    session = started["session"]
    assert started["client_event_id"] == "evt_start"
    assert session["model"] == MODEL and session["status"] == "active"
    assert session["audio"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert session["instructions"] == "Be brief."
    tools = session["delegation"]["responses"]["tools"]
    assert [t["name"] for t in tools] == ["get_weather"]


def test_the_sdk_reads_every_event_as_its_own_type(conversation):
    from openai.types.live import ErrorEvent, SessionClosedEvent, SessionStartedEvent

    kinds = {type(e) for e in conversation["sdk"]}
    assert {SessionStartedEvent, SessionClosedEvent} <= kinds
    assert ErrorEvent not in kinds


def test_both_transcripts_carry_their_timing(conversation):
    for kind in ("session.input_transcript.delta", "session.output_transcript.delta"):
        deltas = _of(conversation, kind)
        assert deltas, kind
        assert all(d["end_ms"] - d["start_ms"] == 80 and d["start_ms"] % 80 == 0
                   for d in deltas)
        starts = [d["start_ms"] for d in deltas]
        assert starts == sorted(starts)


def test_output_audio_is_24_khz_pcm16(conversation):
    deltas = _of(conversation, "session.output_audio.delta")
    sizes = [len(base64.b64decode(d["delta"])) for d in deltas]
    assert deltas and all(size % 2 == 0 for size in sizes)
    # one 80 ms frame at 22.05 kHz is 1764 samples: 1920 at 24 kHz
    assert abs(sum(sizes) / 2 / len(sizes) - 1920) < 200


def test_the_call_is_a_responses_delegation(conversation):
    delegation = conversation["delegated"]["delegation"]
    assert delegation["target"] == "responses" and delegation["response_id"]
    call = conversation["call"]
    assert call["delegation_id"] == delegation["id"]
    assert call["event"]["name"] == "get_weather"
    assert json.loads(call["event"]["arguments"]) == {"city": "Paris"}
    item = conversation["item"]["event"]["item"]
    assert item["type"] == "function_call" and item["status"] == "completed"


def test_the_result_continues_the_delegated_response(conversation):
    continued = conversation["continued"]
    assert continued["delegation_id"] == conversation["delegated"]["delegation"]["id"]
    assert continued["event"]["response"]["status"] == "completed"


def test_mute_and_close_are_acknowledged(conversation):
    assert conversation["muted"]["client_event_id"] == "evt_mute"
    closed = conversation["closed"]
    assert closed["reason"] == "close_requested"
    assert closed["client_event_id"] == "evt_close"
    assert closed["usage"]["seconds"] >= 2


def test_usage_reports_the_bounded_context(conversation):
    updates = _of(conversation, "session.usage.updated")
    assert updates
    ratios = [u["context_window"]["usage_ratio"] for u in updates]
    assert ratios == sorted(ratios) and 0 < ratios[0] <= 1


def test_no_error_event(conversation):
    assert not _of(conversation, "error")


# --- bad input, answered as OpenAI answers it; the session goes on ------------------


def _until_raw(ws, kind: str) -> dict:
    while True:
        event = recv(ws)
        check(event, SEEN)
        if event["type"] == kind:
            return event


def _start(ws, **session) -> dict:
    send(ws, {"type": "session.start", "session": {"model": MODEL, **session}})
    return _until_raw(ws, "session.started")


def _error(ws, message: dict) -> dict:
    """``message``'s error (the events of the audio before it may come first)."""
    send(ws, message)
    return _until_raw(ws, "error")["error"]


def test_an_unknown_field_in_session_start_is_refused(server):
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        error = _error(ws, {"type": "session.start", "event_id": "evt_1",
                            "session": {"model": MODEL, "voice": "marin"}})
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error", "unknown_parameter", "session.voice")
        assert error["client_event_id"] == "evt_1"
        _start(ws)


@pytest.mark.parametrize("session, param", [
    ({"audio": {"format": {"type": "audio/pcm", "rate": 44100}}}, "session.audio.format.rate"),
    ({"delegation": {"type": "responses", "responses": {
        "model": "m", "tools": [{"type": "web_search"}]}}},
     "session.delegation.responses.tools[0].type"),
    ({"delegation": {"type": "decisions", "decisions": {}}}, "session.delegation.type"),
    ({"store": True}, "session.store"),
    ({"delegation": {"type": "responses", "responses": {"model": "m", "x": 1}}},
     "session.delegation.responses.x"),
    ({"delegation": {"type": "responses", "responses": {"model": "m", "reasoning": 5}}},
     "session.delegation.responses.reasoning"),
    ({"delegation": {"type": "responses", "responses": {
        "model": "m", "tool_choice": {"type": "web_search"}}}},
     "session.delegation.responses.tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "hi"}]}]},
     "session.input[0].content[0].type"),
    ({"audio": {"output": {"voice": 3}}}, "session.audio.output.voice"),
    ({"client": {"data_channel": {"allowed_client_events": []}}}, "session.client"),
])
def test_a_session_start_this_server_cannot_honour_names_its_field(server, session, param):
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        error = _error(ws, {"type": "session.start", "session": {"model": MODEL, **session}})
        assert error["param"] == param, error
        _start(ws)


FULL = {
    "model": "gpt-live-1.1", "instructions": "Be brief.", "safety_identifier": "user-1",
    "store": False, "triggers": [],
    "audio": {"format": {"type": "audio/pcmu", "rate": 8000}, "output": {"voice": {"id": "v"}}},
    "input": [{"type": "message", "role": "developer", "content": [{"text": "Rules."}]},
              {"role": "user", "content": [{"type": "input_text", "text": "Hi"}],
               "status": "completed", "id": "msg_1"},
              {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]}],
    "delegation": {"type": "responses", "acknowledgement_delay_ms": 400, "responses": {
        "model": "gpt-5.5", "instructions": "Use tools.", "max_output_tokens": 512,
        "parallel_tool_calls": True, "reasoning": {"effort": "low", "summary": "auto"},
        "text": {"verbosity": "low"}, "service_tier": "priority",
        "tool_choice": {"type": "function", "name": "get_weather"}, "tools": [TOOL]}},
}


def test_every_session_field_is_taken_and_echoed_as_its_type(server, monkeypatch):
    short_tool_prompt(monkeypatch)
    CLIENT_EVENT.validate_python({"type": "session.start", "session": FULL}, strict=True)
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        send(ws, {"type": "session.start", "session": FULL})
        session = _until_raw(ws, "session.started")["session"]  # checked strictly
    assert session["audio"] == {"format": {"type": "audio/pcmu", "rate": 8000},
                                "output": {"voice": {"id": "v"}}}
    assert session["input"] == FULL["input"] and session["safety_identifier"] == "user-1"
    assert session["delegation"] == FULL["delegation"]


def test_audio_before_session_started_is_refused(server):
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        error = _error(ws, {"type": "session.input_audio.append",
                            "audio": base64.b64encode(bytes(4800)).decode()})
        assert error["code"] == "session_not_started"
        _start(ws)
        send(ws, {"type": "session.input_audio.append",
                  "audio": base64.b64encode(bytes(4800)).decode()})
        send(ws, {"type": "session.input_audio.mute"})
        _until_raw(ws, "session.input_audio.muted")


def test_an_append_over_the_cap_is_refused(server):
    server.wait_idle()
    too_long = bytes(24_000 * 2 * MAX_APPEND_SECONDS + 2)
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        _start(ws)
        error = _error(ws, {"type": "session.input_audio.append",
                            "audio": base64.b64encode(too_long).decode()})
        assert (error["code"], error["param"]) == ("invalid_value", "audio")
        assert f"at most {MAX_APPEND_SECONDS} s" in error["message"]
        send(ws, {"type": "session.input_audio.append",
                  "audio": base64.b64encode(bytes(4800)).decode()})
        send(ws, {"type": "session.input_audio.unmute"})
        _until_raw(ws, "session.input_audio.unmuted")


def test_a_result_for_an_unknown_call_is_refused(server, monkeypatch):
    short_tool_prompt(monkeypatch)
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        _start(ws, delegation=SESSION["delegation"])
        error = _error(ws, {"type": "response.item.create", "event_id": "evt_r", "item": {
            "type": "function_call_output", "call_id": "call_nope", "output": RESULT}})
        assert (error["code"], error["param"]) == ("invalid_value", "item.call_id")
        assert "call_nope" in error["message"] and error["client_event_id"] == "evt_r"
        send(ws, {"type": "session.close"})
        assert _until_raw(ws, "session.closed")["reason"] == "close_requested"


def test_new_tools_reopen_before_audio_and_are_refused_after(server, monkeypatch):
    short_tool_prompt(monkeypatch)
    server.wait_idle()
    other = {**TOOL, "name": "get_time"}
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        _start(ws, delegation=SESSION["delegation"])
        send(ws, {"type": "session.update", "session": {"delegation": {
            "type": "responses", "responses": {"tools": [TOOL, other]}}}})
        updated = _until_raw(ws, "session.updated")["session"]
        assert [t["name"] for t in updated["delegation"]["responses"]["tools"]] == [
            "get_weather", "get_time"]
        assert updated["delegation"]["responses"]["model"] == "gpt-5.5"  # kept
        send(ws, {"type": "session.input_audio.append",
                  "audio": base64.b64encode(bytes(4800)).decode()})
        error = _error(ws, {"type": "session.update", "session": {"delegation": {
            "type": "responses", "responses": {"tools": [TOOL]}}}})
        assert error["param"] == "session.delegation.responses.tools"
        error = _error(ws, {"type": "session.update", "session": {"delegation": {
            "type": "client"}}})
        assert error["param"] == "session.delegation.type"


def test_text_appends_after_audio_are_refused_as_the_model_cannot_take_them(server):
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        _start(ws)
        send(ws, {"type": "session.input_audio.append",
                  "audio": base64.b64encode(bytes(4800)).decode()})
        error = _error(ws, {"type": "session.thinking.append", "content": "x",
                            "delegation_id": None})
        assert error["code"] == "unsupported_after_audio"


# One valid event of each client event type, and the event type that answers it (``error``:
# refused as this server cannot do it). Text appends come before the first audio.
CLIENT_CASES = {
    "session.start": ({"session": {"model": MODEL, "delegation": SESSION["delegation"]}},
                      "session.started"),
    "session.update": ({"session": {"delegation": {"type": "responses",
                                                   "acknowledgement_delay_ms": 200}}},
                       "session.updated"),
    "session.instructions.append": ({"content": "Speak slowly.", "delegation_id": None},
                                    "session.instructions.appended"),
    "session.thinking.append": ({"content": "The user is in Paris.", "delegation_id": None},
                                "session.thinking.appended"),
    "session.commentary.append": ({"content": "Welcome!", "delegation_id": None},
                                  "session.commentary.appended"),
    "session.input_audio.append": ({"audio": base64.b64encode(bytes(4800)).decode()}, None),
    "session.input_audio.mute": ({}, "session.input_audio.muted"),
    "session.input_audio.unmute": ({}, "session.input_audio.unmuted"),
    "response.item.create": ({"item": {"type": "function_call_output", "call_id": "call_x",
                                       "output": "{}"}}, "error"),
    "response.create": ({}, "error"),
    "session.output_audio.fixture.play": ({"audio": base64.b64encode(bytes(480)).decode()},
                                          "error"),
    "decision.create": ({}, "error"),
    "decision.item.create": ({"item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hi"}]}}, "error"),
    "decision.item.delete": ({"item_id": "item_1"}, "error"),
    "session.close": ({}, "session.closed"),
}


def test_every_client_event_is_answered(server, monkeypatch):
    """Each type of the openai package's client-event union, valid by its types, is
    answered (or refused, naming the client event), never with an unknown-type error."""
    short_tool_prompt(monkeypatch)
    assert set(CLIENT_CASES) == CLIENT_TYPES, "a GPT-Live client event without a case here"
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers=AUTH) as ws:
        for kind, (fields, answer) in CLIENT_CASES.items():
            message = {"type": kind, "event_id": f"evt_{kind}", **fields}
            CLIENT_EVENT.validate_python(message, strict=True)
            send(ws, message)
            if answer is None:
                continue
            got = _until_raw(ws, answer)
            if answer == "error":
                assert got["error"]["client_event_id"] == f"evt_{kind}"
                assert got["error"].get("param") != "type" or "needs" in got["error"]["message"]
            else:
                assert got.get("client_event_id") == f"evt_{kind}", got


def test_no_session_start_in_time_is_an_error_naming_it(tiny_ckpt):
    limits = ServerLimits(update_timeout=0.5, idle_timeout=10)
    for live in running(LiveServer(create_app(tiny_ckpt, api_key=API_KEY, limits=limits))):
        with connect(live.ws(PATH), additional_headers=AUTH) as ws:
            error = _until_raw(ws, "error")["error"]
    assert error["code"] == "session_expired" and "session.start" in error["message"]


def test_a_deadline_closes_the_session_as_expired(tiny_ckpt):
    limits = ServerLimits(update_timeout=10, idle_timeout=0.5)
    for live in running(LiveServer(create_app(tiny_ckpt, api_key=API_KEY, limits=limits))):
        with connect(live.ws(PATH), additional_headers=AUTH) as ws:
            _start(ws)
            assert _until_raw(ws, "session.closed")["reason"] == "expired"


def test_an_ephemeral_key_opens_a_live_session_once(server):
    import httpx
    from websockets.exceptions import InvalidStatus

    minted = httpx.post(server.http("/openai/v1/realtime/client_secrets"), json={},
                        headers=AUTH)
    key = minted.json()["value"]
    server.wait_idle()
    with connect(server.ws(PATH), additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        _start(ws)
    server.wait_idle()
    with pytest.raises(InvalidStatus) as refused:
        with connect(server.ws(PATH), additional_headers={"Authorization": f"Bearer {key}"}):
            pass
    assert refused.value.response.status_code == 401


def test_a_dropped_session_resumes_with_its_events(tiny_ckpt):
    """``session.started`` carries the resume token; a resume replays what followed."""
    from raw_client import RawClient
    from resume_support import abort, event, reattach, resume_path

    limits = ServerLimits(update_timeout=10, idle_timeout=10, resume_seconds=10)
    for live in running(LiveServer(create_app(tiny_ckpt, api_key=API_KEY, limits=limits))):
        client = RawClient(live.port, PATH, headers=AUTH)
        client.send_json({"type": "session.start", "session": {"model": MODEL}})
        started = event(client)
        check(started, SEEN)
        assert started["type"] == "session.started", started
        client.send_json({"type": "session.input_audio.mute"})
        assert event(client)["type"] == "session.input_audio.muted"
        abort(client)
        again = reattach(live.port, resume_path(PATH, started["session"]["resume_token"],
                                                started["seq"]), headers=AUTH)
        resumed = event(again)
        check(resumed, SEEN)
        assert resumed["type"] == "session.resumed"
        replayed = [event(again) for _ in range(resumed["replayed"])]
        for one in replayed:
            check(one, SEEN)
        assert "session.input_audio.muted" in {e["type"] for e in replayed}
        again.send_json({"type": "session.close"})
        while (got := event(again))["type"] != "session.closed":
            check(got, SEEN)
        again.close()


# --- over WebRTC: aiortc as the peer, the SDK's client.live.create to signal ------------


async def _item_done(caller) -> dict:
    """The delegated call's ``response.output_item.done``, once it came."""
    while True:
        for event in caller.events:
            if event["type"] == "response.event" \
                    and event["event"]["type"] == "response.output_item.done":
                return event
        caller.arrived.clear()
        await caller.arrived.wait()


def _webrtc_call(server, samples) -> dict:
    pytest.importorskip("aiortc")
    from aiortc import RTCSessionDescription
    from rtc_support import TIMEOUT, Caller

    class LiveCaller(Caller):
        async def dial(self, session: dict | None = None, sdp: str | None = None) -> None:
            created = await self.client.live.create(session=session, transport={
                "type": "webrtc", "sdp": sdp or await self.offer()})
            self.call_id = created.session.id
            await self.pc.setRemoteDescription(
                RTCSessionDescription(created.transport.sdp, "answer"))
            await asyncio.wait_for(self.opened.wait(), TIMEOUT)

        async def hang_up(self) -> None:
            await self.client.live.sessions.hangup(self.call_id)

    async def call() -> dict:
        caller = LiveCaller(base_url(server), API_KEY, samples)
        try:
            media = {k: v for k, v in SESSION.items() if k != "audio"}
            await caller.dial(session={**media, "audio": {"output": {"voice": "marin"}}})
            started = await caller.until("session.started")
            caller.microphone.go.set()
            delegated = await caller.until("session.delegation.created", timeout=60)
            call = await asyncio.wait_for(_item_done(caller), TIMEOUT)
            caller.send({"type": "response.item.create", "item": {
                "type": "function_call_output", "call_id": call["event"]["item"]["call_id"],
                "output": RESULT}})
            caller.send({"type": "session.input_audio.mute"})
            await caller.until("session.input_audio.muted")
            await asyncio.wait_for(caller.microphone.finished.wait(), 60)
            caller.send({"type": "session.close"})
            closed = await caller.until("session.closed", timeout=30)
            return {"id": caller.call_id, "started": started, "delegated": delegated,
                    "closed": closed, "events": caller.events, "heard": caller.audio()}
        finally:
            await caller.close()

    return asyncio.run(call())


def test_a_webrtc_session_runs_a_conversation(server, tmp_path):
    import _pytest.monkeypatch
    from rtc_support import question_48k

    patch = _pytest.monkeypatch.MonkeyPatch()
    try:
        script = scripted_call(server, patch)
        server.wait_idle()
        got = _webrtc_call(server, question_48k(call_frames(script) * 0.08 + 0.5))
    finally:
        patch.undo()
    for event in got["events"]:
        check(event, SEEN)
    assert got["started"]["session"]["id"] == got["id"]
    assert got["delegated"]["delegation"]["target"] == "responses"
    assert got["closed"]["reason"] == "close_requested"
    kinds = {e["type"] for e in got["events"]}
    assert "session.input_transcript.delta" in kinds and "error" not in kinds
    assert "session.output_audio.delta" not in kinds  # the audio is on the track
    assert got["heard"].shape[0] > 0


def test_a_webrtc_session_refuses_a_websocket_audio_format(server):
    async def create():
        client = openai.AsyncOpenAI(api_key=API_KEY, base_url=base_url(server))
        try:
            await client.live.create(session={"model": MODEL, "audio": {"format": {
                "type": "audio/pcm", "rate": 24000}}}, transport={"type": "webrtc",
                                                                  "sdp": "v=0"})
        finally:
            await client.close()

    pytest.importorskip("aiortc")
    with pytest.raises(openai.BadRequestError) as refused:
        asyncio.run(create())
    assert refused.value.body["param"] == "session.audio.format"


# --- LiveKit agents-js's GPTLiveModel (Node; `make livekit` installs it) ---------------

LIVEKIT = Path(__file__).resolve().parent.parent / "build" / "livekit" / "node_modules"


def test_livekits_gpt_live_model_runs_a_session(server, tmp_path_factory):
    """The agents-js plugin's GPTLiveModel, given the server as its ``baseURL``: started,
    the question sent, the delegated call answered through the framework, muted, closed,
    and no error event."""
    import shutil
    import subprocess
    import wave

    node = shutil.which("node")
    if node is None or not (LIVEKIT / "@livekit" / "agents-plugin-openai").is_dir():
        pytest.skip("LiveKit agents-js is not installed (make livekit, with Node)")
    with scripted_question(server, tmp_path_factory, "livekit") as (_, wav):
        with wave.open(str(wav)) as question:
            pcm = wav.with_suffix(".pcm")
            pcm.write_bytes(question.readframes(question.getnframes()))
        script = Path(__file__).resolve().parent / "livekit_gpt_live.cjs"
        run = subprocess.run([node, str(script), base_url(server), API_KEY, str(pcm)],
                             capture_output=True, text=True, timeout=120,
                             env={"NODE_PATH": str(LIVEKIT), "PATH": os.environ["PATH"]})
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["errors"] == []
    for event in got["events"]:  # as the plugin read them
        check(event, SEEN)
    assert got["events"][-1]["type"] == "session.closed"
    assert got["sessionId"].startswith("sess_")
    assert [c["name"] for c in got["calls"]] == ["get_weather"]
    assert json.loads(got["calls"][0]["args"]) == {"city": "Paris"}
    assert got["transcripts"] and got["audioFrames"] > 0


def test_every_event_type_the_dialect_sends_was_checked(request):
    """The event types in the dialect's source (:func:`live_schema.emitted_types`), each
    validated by a test above."""
    every_type_checked(request, emitted_types(), SEEN, "GPT-Live")
