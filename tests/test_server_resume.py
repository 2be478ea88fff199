"""A dropped connection loses nothing: a session resumes within its window (issue 42).

A resumable session (``--resume-seconds``) numbers its events (``seq``) and
names itself in its first one (``session.resume_token``). When its TCP
connection drops (a reset, no close frame) it is detached: paused, holding
its slot, its events kept. A client that opens the same path with
``?resume_token=...&last_seq=N`` gets ``session.resumed`` (how much of its
audio the server holds), the events after ``N``, and the session goes on:
what the client reads, end to end, equals an undisturbed run exactly.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from raw_client import RawClient
from resume_support import (Conversation, abort, event, metric, numbered, resume_path, stream,
                            until)
from server_support import FRAME, LiveServer, append_message, connect, running
from tool_support import VALID, WEATHER, Script, short_tool_prompt
from websockets.exceptions import InvalidStatus

from mlx_voicechat_plugin.runtime.tools import render_tool_response
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.soak

KEY_ENV = "VOICECHAT_RESUME_TEST_KEY"
WAIT = 10.0
STORM_SESSIONS = 3  # of bench.soak's 10 cycles each (make soak runs 200 cycles)


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=5, idle_timeout=5, resume_seconds=5)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits, api_key_env=KEY_ENV)))


@pytest.fixture(scope="module")
def short_window(tiny_ckpt):
    limits = ServerLimits(update_timeout=5, idle_timeout=5, resume_seconds=0.3)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits, api_key_env=None)))


# --- the conversation resumed equals the undisturbed one -----------------------------


@pytest.fixture(scope="module")
def tool_runs(server, tiny_ckpt):
    """One undisturbed scripted tool-call conversation and the same dropped at three points."""
    monkeypatch = pytest.MonkeyPatch()
    short_tool_prompt(monkeypatch)
    voicechat = server.app.state.engine.voicechat
    script = Script(voicechat.tokenizer, voicechat.config.pad_token_id, VALID).install(
        monkeypatch)
    tool_at = script.start + len(script.tokens)
    frames = tool_at + len(script.tokenizer_encode(render_tool_response('{"temp": 21}'))) + 4
    signal = question_signal(frames * 0.08 + 0.1)
    drops = {"undisturbed": None, "before": 1, "during": tool_at - 1, "after": tool_at + 1,
             "silent": tool_at - 1}
    runs = {}
    try:
        for name, drop_at in drops.items():
            script.inputs.clear()
            script.forced.clear()
            conversation = Conversation(server.port, signal, tool_at)
            conversation.start(seed=3, tools=[WEATHER])
            runs[name] = conversation, conversation.run(frames, drop_at, name == "silent")
            server.wait_idle()
    finally:
        monkeypatch.undo()
    return runs


@pytest.mark.parametrize("drop", ["before", "during", "after", "silent"])
def test_a_dropped_and_resumed_conversation_reads_as_an_undisturbed_one(tool_runs, drop):
    _, undisturbed = tool_runs["undisturbed"]
    conversation, events = tool_runs[drop]
    assert len(conversation.resumes) == 1
    assert stream(events) == stream(undisturbed)
    kinds = {e["type"] for e in stream(events)}
    assert {"response.audio.delta", "response.function_call_arguments.done",
            "conversation.item.function_call_output.injected"} <= kinds


@pytest.mark.parametrize("drop", ["before", "during", "after", "silent"])
def test_seq_is_gap_free_across_the_resume(tool_runs, drop):
    _, events = tool_runs[drop]
    assert numbered(events) == list(range(1, len(numbered(events)) + 1))


def test_the_resume_replays_what_the_drop_lost(server):
    """The frames sent before the drop ran while nobody listened: their events come back."""
    token, last = _detached(server)
    session = server.app.state.resumes.sessions[token]
    # Both frames sent before the drop have run (their events are numbered on the loop in
    # the same step that counts them), so none runs between the resume and the check.
    until(lambda: session.frames_seen >= 2, "the sent frames' events")
    client = _resume(server, token, last)
    resumed = event(client)
    assert resumed["replayed"] == session.replay.seq - last > 0
    replayed = [event(client) for _ in range(resumed["replayed"])]
    assert [e["seq"] for e in replayed] == list(range(last + 1, last + 1 + len(replayed)))
    _finish(client)
    server.wait_idle()


# --- the contract on the wire -----------------------------------------------------


def test_the_first_event_carries_a_resume_token_and_every_event_a_seq(server):
    with connect(server.ws()) as ws:
        created = json.loads(ws.recv(timeout=WAIT))
        token = created["session"]["resume_token"]
        assert created["seq"] == 1 and len(token) >= 32
        ws.send('{"type": "session.ping"}')
        assert json.loads(ws.recv(timeout=WAIT))["seq"] == 2


def _detached(server, headers: dict | None = None, scrape: dict | None = None,
              **session) -> tuple[str, int]:
    """A configured session whose connection dropped: its token and last seq read
    (``scrape``: the headers /metrics takes, if not ``headers``)."""
    client = RawClient(server.port, headers=headers)
    created = event(client)
    client.send_json({"type": "session.update", "session": session})
    updated = event(client)
    assert updated["type"] == "session.updated"
    client.send_json(append_message(question_signal(0.3)[:2 * FRAME]))
    client.close()  # the TCP connection ends (a FIN after the audio), no close frame
    until(lambda: metric(server, "voicechat_detached_sessions", scrape or headers) == 1,
          "the detach")
    return created["session"]["resume_token"], updated["seq"]


def _resume(server, token: str, last_seq: int) -> RawClient:
    return RawClient(server.port, resume_path("/v1/realtime", token, last_seq))


def _refused(server, token: str, last_seq: int | str = 0, **kwargs) -> tuple[int, dict]:
    with pytest.raises(InvalidStatus) as refused:
        with connect(server.ws(resume_path("/v1/realtime", token, last_seq)), **kwargs):
            pass
    response = refused.value.response
    return response.status_code, json.loads(response.body)["error"]


def _finish(client: RawClient) -> list[dict]:
    """Commit the resumed session and read it to its end."""
    client.send_json({"type": "input_audio_buffer.commit"})
    events = []
    while (got := event(client))["type"] != "response.done":
        events.append(got)
    client.close()
    return events


def test_a_resume_says_how_much_audio_the_server_holds(server):
    token, last = _detached(server)
    client = _resume(server, token, last)
    resumed = event(client)
    assert resumed["audio_received_samples"] == 2 * FRAME
    assert resumed["audio_sample_rate"] == 16_000 and resumed["last_seq"] == last
    _finish(client)
    server.wait_idle()


def test_a_resume_takes_the_session_from_a_link_that_went_silent(tool_runs):
    """A half-open link (the server never saw it drop) does not hold the session hostage:
    the resume takes it at once, and the old connection is closed, 1000, saying why."""
    conversation, _ = tool_runs["silent"]
    assert conversation.superseded == (1000, "the session was resumed on another connection")


def test_the_newest_resume_wins_and_the_session_goes_on(server):
    token, last = _detached(server)
    first = _resume(server, token, last)
    assert event(first)["type"] == "session.resumed"
    second = _resume(server, token, last)
    assert event(second)["type"] == "session.resumed"
    assert first.close_frame() == (1000, "the session was resumed on another connection")
    first.close()
    assert metric(server, "voicechat_sessions_resumed_total") >= 2
    assert _finish(second) is not None
    server.wait_idle()


def test_a_wrong_token_is_refused(server):
    status, error = _refused(server, "no-such-token")
    assert (status, error["code"]) == (404, "session_not_found")


def test_an_expired_token_is_refused_and_its_session_freed(short_window):
    token, last = _detached(short_window)
    until(lambda: short_window.health().json()["sessions"] == 0, "the window to end")
    status, error = _refused(short_window, token, last)
    assert (status, error["code"]) == (410, "session_expired")
    assert "--resume-seconds" in error["message"]
    health = short_window.health().json()
    assert health["sessions"] == 0 and health["reserved_state_bytes"] == 0
    assert metric(short_window, "voicechat_sessions_resume_expired_total") >= 1


def test_a_token_of_another_key_is_refused_and_the_session_unharmed(server, monkeypatch):
    first, second = ({"Authorization": f"Bearer {k}"} for k in ("first-key", "second-key"))
    monkeypatch.setenv(KEY_ENV, "first-key")  # the key is read at each request
    token, last = _detached(server, headers=first)
    monkeypatch.setenv(KEY_ENV, "second-key")
    status, error = _refused(server, token, last, additional_headers=second)
    assert (status, error["code"]) == (404, "session_not_found")  # told nothing
    monkeypatch.setenv(KEY_ENV, "first-key")
    client = RawClient(server.port, resume_path("/v1/realtime", token, last), headers=first)
    assert event(client)["type"] == "session.resumed"
    _finish(client)
    server.wait_idle()


def test_a_last_seq_past_what_was_sent_is_refused(server):
    token, last = _detached(server)
    status, error = _refused(server, token, last + 1000)
    assert (status, error["code"]) == (400, "invalid_request")
    _finish(_resume(server, token, last))
    server.wait_idle()


def test_a_clean_close_ends_the_session_as_before(server):
    with connect(server.ws()) as ws:
        ws.recv(timeout=WAIT)
    server.wait_idle()
    assert server.health().json()["sessions"] == 0


def test_metrics_count_detached_and_resumed_sessions(server):
    before = metric(server, "voicechat_sessions_resumed_total")
    token, last = _detached(server)
    _finish(_resume(server, token, last))
    server.wait_idle()
    assert metric(server, "voicechat_sessions_resumed_total") == before + 1
    assert metric(server, "voicechat_sessions_detached_total") >= 1
    assert metric(server, "voicechat_detached_sessions") == 0


# --- the storm, the drain, and resuming off ---------------------------------------


def test_a_storm_of_drops_and_resumes_leaves_threads_fds_and_sessions_flat(server):
    from bench.soak import resumed_session

    resumed_session(server, 2)  # warm-up
    server.wait_idle()
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    for _ in range(STORM_SESSIONS):
        resumed_session(server)
        server.wait_idle()
    until(lambda: threading.active_count() <= threads, "the threads to settle")
    # The server closes a reset connection's socket when it notices the reset: wait for it.
    until(lambda: len(os.listdir("/proc/self/fd")) <= fds, "the sockets to close")
    resumes = server.app.state.resumes
    until(lambda: not resumes.sessions, "the resumed sessions to end")
    assert metric(server, "voicechat_detached_sessions") == 0


def test_a_drain_ends_the_detached_sessions_and_frees_them(tiny_ckpt):
    live = LiveServer(create_app(tiny_ckpt, limits=ServerLimits(resume_seconds=30),
                                 api_key_env=None))
    try:
        token, last = _detached(live)
        drain = live.app.state.drain
        drain.loop.call_soon_threadsafe(drain.begin)
        until(lambda: live.health().json()["sessions"] == 0, "the detached session's end")
        status, error = _refused(live, token, last)
        assert (status, error["code"]) == (410, "session_expired")
        assert "draining" in error["message"]
    finally:
        live.stop()


def test_resume_seconds_0_is_the_old_behaviour(tiny_ckpt):
    live = LiveServer(create_app(tiny_ckpt, limits=ServerLimits(resume_seconds=0),
                                 api_key_env=None))
    try:
        client = RawClient(live.port)
        created = event(client)
        assert "resume_token" not in created["session"] and "seq" not in created
        abort(client)
        live.wait_idle()
        assert live.health().json()["sessions"] == 0
    finally:
        live.stop()


# --- every dialect ------------------------------------------------------------------

GA_PATH, NVIDIA_PATH = "/openai/v1/realtime", "/nvidia/v1/realtime"


def _dropped_in(server, path: str, update: dict, audio: list) -> tuple[str, int]:
    """A session at ``path``: created (token, seq 1), updated, fed ``audio``, dropped."""
    client = RawClient(server.port, path)
    created = event(client)
    assert created["type"] == "session.created" and created["seq"] == 1
    client.send_json(update)
    updated = event(client)
    assert updated["type"] == "session.updated" and updated["seq"] == 2
    for message in audio:
        client.send_frame(message, opcode=0x2) if isinstance(message, bytes) \
            else client.send_json(message)
    client.close()  # the TCP connection ends (a FIN after the audio), no close frame
    until(lambda: metric(server, "voicechat_detached_sessions") == 1, "the detach")
    return created["session"]["resume_token"], updated["seq"]


def _resumed_in(server, path: str, token: str, last: int) -> dict:
    client = RawClient(server.port, resume_path(path, token, last))
    resumed = event(client)
    following = [event(client) for _ in range(resumed["replayed"])]
    assert [e["seq"] for e in following] == list(range(last + 1, last + 1 + len(following)))
    client.send_frame(b"\x03\xe8", opcode=0x8)  # a clean close: the session ends
    client.close()
    server.wait_idle()
    return resumed


def test_a_ga_session_resumes_counting_audio_in_its_input_format(server):
    pcm = (np.zeros(2 * 1920, "<i2")).tobytes()  # 160 ms of 24 kHz PCM16
    token, last = _dropped_in(server, GA_PATH, {"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": None}}}},
        [{"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}])
    resumed = _resumed_in(server, GA_PATH, token, last)
    assert resumed["type"] == "session.resumed"
    assert (resumed["audio_received_samples"], resumed["audio_sample_rate"]) == (3840, 24_000)


def test_an_nvidia_session_resumes_counting_audio_at_its_input_rate(server):
    token, last = _dropped_in(server, NVIDIA_PATH, {"type": "session.update", "session": {}},
                              [np.zeros(1920, "<i2").tobytes()] * 2)
    resumed = _resumed_in(server, NVIDIA_PATH, token, last)
    assert resumed["type"] == "session.resumed"
    assert (resumed["audio_received_samples"], resumed["audio_sample_rate"]) == (3840, 24_000)


def test_a_resume_at_another_dialects_path_is_refused(server):
    token, last = _detached(server)
    with pytest.raises(InvalidStatus) as refused:
        with connect(server.ws(resume_path(GA_PATH, token, last))):
            pass
    assert refused.value.response.status_code == 409
    _finish(_resume(server, token, last))
    server.wait_idle()


def _minted(server, monkeypatch) -> str:
    """An ephemeral key minted with the server's key (``client_secrets``)."""
    monkeypatch.setenv(KEY_ENV, "server-key")
    minted = httpx.post(server.http("/openai/v1/realtime/client_secrets"), json={},
                        headers={"Authorization": "Bearer server-key"})
    assert minted.status_code == 200, minted.text
    return minted.json()["value"]


def test_a_session_opened_with_an_ephemeral_key_resumes_with_that_key_only(server, monkeypatch):
    first, second = ({"Authorization": f"Bearer {_minted(server, monkeypatch)}"}
                     for _ in range(2))
    token, last = _detached(server, headers=first, scrape={"Authorization": "Bearer server-key"})
    status, error = _refused(server, token, last, additional_headers=second)
    assert (status, error["code"]) == (404, "session_not_found")  # told nothing
    client = RawClient(server.port, resume_path("/v1/realtime", token, last), headers=first)
    assert event(client)["type"] == "session.resumed"
    _finish(client)
    server.wait_idle()


def test_a_made_up_ephemeral_key_cannot_tell_live_ended_and_unknown_tokens_apart(
        server, monkeypatch):
    """Issue 63, finding 10: ``Bearer ek_<anything>`` with ``?resume_token=`` skipped the
    key check, and the answer (403, 410, 404, with the reason) said which tokens live."""
    monkeypatch.setenv(KEY_ENV, "server-key")
    owner = {"Authorization": "Bearer server-key"}
    ended, last = _detached(server, headers=owner)
    _finish(RawClient(server.port, resume_path("/v1/realtime", ended, last), headers=owner))
    server.wait_idle()
    live, live_last = _detached(server, headers=owner)
    forged = {"Authorization": "Bearer ek_" + "0" * 48}
    answers = {json.dumps(_refused(server, token, seq, additional_headers=forged))
               for token, seq in ((live, live_last), (ended, last), ("no-such-token", 0))}
    assert len(answers) == 1, answers
    status, error = json.loads(answers.pop())
    assert (status, error["code"]) == (404, "session_not_found")
    # The owner is still told the truth, and the live session is unharmed.
    assert _refused(server, ended, last, additional_headers=owner)[0] == 410
    client = RawClient(server.port, resume_path("/v1/realtime", live, live_last), headers=owner)
    assert event(client)["type"] == "session.resumed"
    _finish(client)
    server.wait_idle()


# --- a replay larger than the outbox ------------------------------------------------


PENDING_BYTES = 32 * 1024  # a few audio deltas
SEND_BUFFER = 4096  # accepted sockets inherit it: the replay waits in the outbox, not the kernel


@pytest.fixture(scope="module", params=["events", "bytes"])
def small_outbox(tiny_ckpt, request):
    bound = ({"max_pending_events": 16} if request.param == "events"
             else {"max_pending_bytes": PENDING_BYTES})
    limits = ServerLimits(update_timeout=5, idle_timeout=5, resume_seconds=10, **bound)
    live = LiveServer(create_app(tiny_ckpt, limits=limits, api_key_env=None))
    live.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    yield from running(live)


def test_a_replay_twice_the_outbox_is_delivered_in_order_and_the_session_goes_on(small_outbox):
    """Issue 63, finding 3: the whole replay went into the outbox at once, so a replay
    past ``--max-pending-events`` said ``session.resumed``, sent what fit, then closed
    1008 ("client is not reading") and released the session it had promised. A replay
    is promised, so it is not counted against ``--max-pending-bytes`` either."""
    server, frames = small_outbox, 40
    client = RawClient(server.port)
    token = event(client)["session"]["resume_token"]
    client.send_json({"type": "session.update", "session": {}})
    last = event(client)["seq"]
    audio = question_signal(frames * FRAME / 16_000)
    for index in range(frames):
        client.send_json(append_message(audio[index * FRAME:(index + 1) * FRAME]))
    client.send_json({"type": "session.ping"})  # answered once the frames have run
    while event(client)["type"] != "session.pong":
        pass
    abort(client)
    session = server.app.state.resumes.sessions[token]
    until(lambda: session.detached_or_claimed, "the detach")
    # The events after session.updated were lost on the way: all of them are asked again.
    client = RawClient(server.port, resume_path("/v1/realtime", token, last))
    resumed = event(client)
    assert resumed["type"] == "session.resumed"
    # A new event while the replay waits unread: it is what counts, not the replay.
    client.send_json({"type": "session.ping"})
    time.sleep(0.5)
    limits = server.app.state.limits
    replayed = [client.read_frame()[1] for _ in range(resumed["replayed"])]
    assert (len(replayed) >= 2 * limits.max_pending_events
            or sum(map(len, replayed)) >= 2 * limits.max_pending_bytes)
    replayed = [json.loads(frame) for frame in replayed]
    assert [e["seq"] for e in replayed] == list(range(last + 1, last + 1 + len(replayed)))
    while (got := event(client))["type"] != "session.pong":
        assert got["type"] != "error", got
    _finish(client)
    server.wait_idle()


# --- the per-key limits count what a key mints -------------------------------------------


@pytest.fixture(scope="module")
def three_slots(tiny_ckpt):
    limits = ServerLimits(update_timeout=5, idle_timeout=5, resume_seconds=10, max_sessions=3,
                          max_detached_per_key=2)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits, api_key_env=KEY_ENV)))


def _end(server, tokens) -> None:
    """End these detached sessions (on the server's loop)."""
    for token in tokens:
        session = server.app.state.resumes.sessions[token]
        server.app.state.drain.loop.call_soon_threadsafe(session.end_detached, "test over")


def test_ephemeral_keys_count_against_the_key_that_minted_them(three_slots, monkeypatch):
    """Issue 63, finding 5: minting an ephemeral key per connection bypassed
    ``--max-detached-per-key``: each key held its own two detached sessions."""
    server, scrape = three_slots, {"Authorization": "Bearer server-key"}
    tokens = []
    for _ in range(3):
        client = RawClient(server.port, headers={
            "Authorization": f"Bearer {_minted(server, monkeypatch)}"})
        tokens.append(event(client)["session"]["resume_token"])
        client.send_json({"type": "session.update", "session": {}})
        assert event(client)["type"] == "session.updated"
        client.close()
        until(lambda: metric(server, "voicechat_detached_sessions", scrape) > 0 and
              metric(server, "voicechat_sessions_detached_total", scrape) >= len(tokens),
              "the detach")
    until(lambda: server.health().json()["sessions"] == 2, "the oldest to end")
    assert metric(server, "voicechat_detached_sessions", scrape) == 2
    assert tokens[0] not in server.app.state.resumes.sessions  # the minting key's oldest
    assert all(t in server.app.state.resumes.sessions for t in tokens[1:])
    _end(server, tokens[1:])
    until(lambda: server.health().json()["sessions"] == 0, "the slots to be free")


def test_a_full_server_takes_the_slot_of_the_key_holding_the_most(three_slots, monkeypatch):
    """Issue 63, finding 5: the longest-detached session of any key gave its slot, so one
    key could hold every slot while another's lone session was ended."""
    server, resumes = three_slots, three_slots.app.state.resumes
    monkeypatch.setenv(KEY_ENV, "second-key")
    lone, _ = _detached(server, headers={"Authorization": "Bearer second-key"})
    monkeypatch.setenv(KEY_ENV, "first-key")
    first = {"Authorization": "Bearer first-key"}
    hoard = []
    for _ in range(2):
        client = RawClient(server.port, headers=first)
        hoard.append(event(client)["session"]["resume_token"])
        client.send_json({"type": "session.update", "session": {}})
        assert event(client)["type"] == "session.updated"
        client.close()
        until(lambda: resumes.sessions[hoard[-1]].detached_or_claimed, "the detach")
    newcomer = RawClient(server.port, headers=first)
    assert event(newcomer)["type"] == "session.created"
    newcomer.send_json({"type": "session.update", "session": {}})
    assert event(newcomer)["type"] == "session.updated"
    assert lone in resumes.sessions and hoard[0] not in resumes.sessions
    newcomer.send_json({"type": "session.cancel"})
    newcomer.close()
    _end(server, (lone, hoard[1]))
    until(lambda: server.health().json()["sessions"] == 0, "the slots to be free")
