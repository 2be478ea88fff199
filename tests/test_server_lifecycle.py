"""A slot nobody can hold hostage (issue 51), through real sockets, in every dialect.

On the default server (``--max-sessions 1``, ``--resume-seconds 15``) a client
that drops (a TCP reset, no close frame) keeps its session resumable only
while no one else needs the slot: a connection that finds the server full
takes the slot of the longest-detached session, which ends, and a later
resume of it is refused saying so. A session never configured is not kept
at all. One key holds at most ``--max-detached-per-key`` detached sessions.
A client that closes and opens again at once never meets ``server_busy``
while no more clients than ``--max-sessions`` want sessions.
"""

from __future__ import annotations

import base64
import gc
import json
import logging
import os
import struct
import threading

import numpy as np
import pytest
from raw_client import RawClient
from resume_support import abort, event, metric, reattach, resume_path, until
from server_support import FRAME, LiveServer, append_message, connect, running
from websockets.exceptions import InvalidStatus

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.operations.replica import agent_line, replica_status
SLOT_TAKEN = "given to a new connection"

KEY_ENV = "VOICECHAT_LIFECYCLE_TEST_KEY"
CLOSE, NORMAL = 0x8, 1000
REOPENS = 40  # sessions in all, over the clients that close and reopen at once
DROPS = 200  # open-and-drop cycles from one key

PCM24 = base64.b64encode(np.zeros(2 * 1920, "<i2").tobytes()).decode()
DIALECTS = {
    "vlm": ("/v1/realtime", {}, lambda: append_message(np.zeros(2 * FRAME, np.float32))),
    "ga": ("/openai/v1/realtime", {"type": "realtime", "audio": {"input": {
        "turn_detection": None}}}, lambda: {"type": "input_audio_buffer.append", "audio": PCM24}),
    "nvidia": ("/nvidia/v1/realtime", {}, lambda: np.zeros(1920, "<i2").tobytes()),
}


def serve(tiny_ckpt, **limits) -> LiveServer:
    base = {"update_timeout": 10, "idle_timeout": 10}
    return LiveServer(create_app(tiny_ckpt, limits=ServerLimits(**{**base, **limits}),
                                 api_key_env=KEY_ENV))


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    """The default server's slots and window: one session, 15 s to resume."""
    yield from running(serve(tiny_ckpt))


def send(client: RawClient, message) -> None:
    if isinstance(message, bytes):
        client.send_frame(message, opcode=0x2)
    else:
        client.send_json(message)


def opened(live: LiveServer, dialect: str, headers: dict | None = None) -> tuple[RawClient, str]:
    """A client admitted at ``dialect``'s path: its socket and its resume token."""
    client = RawClient(live.port, DIALECTS[dialect][0], headers=headers)
    created = event(client)
    assert created["type"] == "session.created", created
    return client, created["session"].get("resume_token", "")


def configured(live: LiveServer, dialect: str, headers: dict | None = None
               ) -> tuple[RawClient, str, int]:
    """A configured session fed a little audio: socket, token, last seq read."""
    client, token = opened(live, dialect, headers)
    client.send_json({"type": "session.update", "session": DIALECTS[dialect][1]})
    while (got := event(client))["type"] != "session.updated":
        assert got["type"] != "error", got
    send(client, DIALECTS[dialect][2]())
    return client, token, got["seq"]


ERROR_TYPED = {"ga", "nvidia"}  # their error object says its type (OpenAI's, NVIDIA's)


def refused_resume(live: LiveServer, dialect: str, token: str, last: int) -> tuple[int, dict]:
    """A resume's HTTP refusal: its status and error, in the dialect's error shape."""
    with pytest.raises(InvalidStatus) as refused:
        with connect(live.ws(resume_path(DIALECTS[dialect][0], token, last))):
            pass
    response = refused.value.response
    body = json.loads(response.body)
    assert body["type"] == "error"
    assert ("type" in body["error"]) == (dialect in ERROR_TYPED), body
    return response.status_code, body["error"]


def clean_close(client: RawClient) -> None:
    client.send_frame(struct.pack("!H", NORMAL), opcode=CLOSE)
    client.close_frame()
    client.close()


def settled(live: LiveServer) -> None:
    """No session holds a slot and none is detached."""
    until(lambda: live.health().json()["sessions"] == 0, "every slot to be free")
    assert live.health().json()["detached"] == 0


# --- a dropped client never delays the next ----------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_newcomer_takes_the_slot_of_a_detached_session_and_its_resume_is_refused(
        server, dialect):
    before = metric(server, "voicechat_sessions_reclaimed_total")
    client, token, last = configured(server, dialect)
    abort(client)  # mid answer: its audio is still running
    until(lambda: metric(server, "voicechat_detached_sessions") == 1, "the detach")
    health = server.health().json()  # the balancer sees the slot as free
    assert (health["free"], health["capacity"], health["detached"]) == (1, 1, 1)
    assert agent_line(replica_status(server.app.state.engine)) == "up ready maxconn:1\n"
    newcomer, _ = opened(server, dialect)  # admitted at once, well inside the window
    # The slot is taken when the newcomer is a real session (configured), not before.
    assert metric(server, "voicechat_sessions_reclaimed_total") == before
    newcomer.send_json({"type": "session.update", "session": DIALECTS[dialect][1]})
    while (got := event(newcomer))["type"] != "session.updated":
        assert got["type"] != "error", got
    assert metric(server, "voicechat_sessions_reclaimed_total") == before + 1
    status, error = refused_resume(server, dialect, token, last)
    assert (status, error["code"]) == (410, "session_expired")
    assert SLOT_TAKEN in error["message"]
    clean_close(newcomer)
    settled(server)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_newcomer_that_never_configures_ends_no_detached_session(server, dialect):
    """Issue 63, finding 5: a connection that found the server full ended the
    longest-detached session at once, though it never became a session."""
    before = metric(server, "voicechat_sessions_reclaimed_total")
    client, token, last = configured(server, dialect)
    abort(client)
    until(lambda: metric(server, "voicechat_detached_sessions") == 1, "the detach")
    idle, _ = opened(server, dialect)  # greeted, then says nothing
    clean_close(idle)
    assert metric(server, "voicechat_sessions_reclaimed_total") == before
    resumed = reattach(server.port, resume_path(DIALECTS[dialect][0], token, last))
    assert event(resumed)["type"] == "session.resumed"
    clean_close(resumed)
    settled(server)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_session_never_configured_ends_when_its_client_drops(server, dialect):
    client, token = opened(server, dialect)
    abort(client)
    settled(server)  # not detached: nothing to resume
    status, error = refused_resume(server, dialect, token, 1)
    assert status == 410 and error["code"] == "session_expired"
    clean_close(opened(server, dialect)[0])
    settled(server)


@pytest.fixture(scope="module")
def brief_window_server(tiny_ckpt):
    """The default server but for a 1 s resume window: a session detached by a drop
    ends when the window passes, here without waiting the default's 15 s."""
    yield from running(serve(tiny_ckpt, resume_seconds=1.0))


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_client_dropped_mid_session_update_frees_the_slot_and_logs_no_error(
        brief_window_server, dialect, caplog):
    """Its prefill is stopped and its slot freed (or, when the update completed before
    the server saw the drop, the session is detached, the newcomer is admitted at once,
    and the detached session ends with its window)."""
    server = brief_window_server
    gc.collect()  # earlier tests' garbage is not this server's
    caplog.set_level(logging.INFO)
    for _ in range(3):
        client, _ = opened(server, dialect)
        client.send_json({"type": "session.update", "session": DIALECTS[dialect][1]})
        abort(client)  # while its prompt prefills
        until(lambda: server.health().json()["free"] == 1, "the slot to be free")
        clean_close(opened(server, dialect)[0])
        settled(server)
    gc.collect()  # a future whose exception nobody took is logged when collected
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


def test_a_resume_within_the_window_while_the_server_has_room_loses_nothing(server):
    client, token, last = configured(server, "vlm")
    abort(client)
    until(lambda: metric(server, "voicechat_detached_sessions") == 1, "the detach")
    resumed = RawClient(server.port, resume_path("/v1/realtime", token, last))
    assert event(resumed)["type"] == "session.resumed"
    clean_close(resumed)
    settled(server)


def test_one_key_holds_at_most_max_detached_per_key_sessions(tiny_ckpt, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "the-key")
    auth = {"Authorization": "Bearer the-key"}
    live = serve(tiny_ckpt, max_sessions=4, max_detached_per_key=2)
    try:
        tokens = []
        for _ in range(3):
            client, token, last = configured(live, "vlm", auth)
            abort(client)
            tokens.append((token, last))
            until(lambda: live.health().json()["detached"] == min(len(tokens), 2),
                  "the detach")
        status, error = _refused_with(live, *tokens[0], auth)
        assert (status, error["code"]) == (410, "session_expired")
        assert "--max-detached-per-key" in error["message"]
        for token, last in tokens[1:]:  # the two newest still resume
            resumed = RawClient(live.port, resume_path("/v1/realtime", token, last),
                                headers=auth)
            assert event(resumed)["type"] == "session.resumed"
            clean_close(resumed)
        settled(live)
    finally:
        live.stop()


def _refused_with(live: LiveServer, token: str, last: int, headers: dict) -> tuple[int, dict]:
    with pytest.raises(InvalidStatus) as refused:
        with connect(live.ws(resume_path("/v1/realtime", token, last)),
                     additional_headers=headers):
            pass
    response = refused.value.response
    return response.status_code, json.loads(response.body)["error"]


def test_open_and_drop_cycles_from_one_key_leave_every_slot_usable_and_nothing_behind(server):
    """Half of the cycles drop a configured session (detached, then taken by the next
    newcomer), half drop one never configured; threads and fds come back flat."""
    configured(server, "vlm")[0].close()  # warm-up
    until(lambda: metric(server, "voicechat_detached_sessions") == 1, "the detach")
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    for cycle in range(DROPS):
        dialect = list(DIALECTS)[cycle % len(DIALECTS)]
        if cycle % 2:
            client, _, _ = configured(server, dialect)
        else:
            client, _ = opened(server, dialect)
        abort(client)
    newcomer, _, _ = configured(server, "ga")  # a session: takes whatever is detached
    clean_close(newcomer)
    settled(server)
    until(lambda: threading.active_count() <= threads, "the threads to settle")
    until(lambda: len(os.listdir("/proc/self/fd")) <= fds, "the sockets to close")
    resumes = server.app.state.resumes
    until(lambda: not resumes.sessions, "the detached sessions to end")
    assert len(resumes.ended) <= 1024
    assert server.app.state.engine.admission.reserved_bytes == 0


# --- close and reopen at once --------------------------------------------------------


def reopen_refusals(live: LiveServer, dialect: str, clients: int) -> list[dict]:
    """``clients`` each open a session, stream, close it (a close frame) and open the next
    at once, ``REOPENS`` sessions in all; the refusals met."""
    refused: list[dict] = []
    lock = threading.Lock()
    path, update, audio = DIALECTS[dialect]

    def client() -> None:
        for _ in range(REOPENS // clients):
            ws = RawClient(live.port, path)
            try:
                first = event(ws)
                if first["type"] != "session.created":
                    with lock:
                        refused.append(first)
                    continue
                ws.send_json({"type": "session.update", "session": update})
                while event(ws)["type"] != "session.updated":
                    pass
                for _ in range(3):
                    send(ws, audio())
                ws.send_frame(struct.pack("!H", NORMAL), opcode=CLOSE)
                ws.close_frame()
            finally:
                ws.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return refused


@pytest.mark.parametrize("dialect", DIALECTS)
def test_clients_that_close_and_reopen_at_once_are_never_refused_on_one_slot(server, dialect):
    settled(server)
    assert reopen_refusals(server, dialect, 1) == []
    settled(server)


@pytest.fixture(scope="module")
def four_slots(tiny_ckpt):
    yield from running(serve(tiny_ckpt, max_sessions=4))


@pytest.mark.parametrize("dialect", DIALECTS)
def test_four_clients_that_close_and_reopen_at_once_are_never_refused_on_four_slots(
        four_slots, dialect):
    settled(four_slots)
    assert reopen_refusals(four_slots, dialect, 4) == []
    settled(four_slots)


def test_max_detached_per_key_is_a_positive_count_named_when_refused():
    with pytest.raises(ValueError, match="max_detached_per_key"):
        ServerLimits(max_detached_per_key=0)
    assert ServerLimits().max_detached_per_key == 4
