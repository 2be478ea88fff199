"""A replica's state for a balancer, without one: the agent-check line, /health, the drain.

The agent-check lines are read here as HAProxy reads them (a port of
``tcpcheck_agent_expect_reply``'s word rules), so a line HAProxy would
misread fails here, not only behind a real HAProxy (tests/test_replicas_haproxy.py).
"""

from __future__ import annotations

import signal
import socket
import time

import httpx
import pytest
from server_support import (
    FRAME,
    LiveServer,
    ServerProcess,
    append_message,
    configure,
    connect,
    expect_error,
    recv,
    running,
    send,
    until_closed,
)
from websockets.exceptions import ConnectionClosed

from mlx_voicechat_plugin.runtime.ledger import ReservationLedger
from mlx_voicechat_plugin.server.engine.admission import Admission
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.operations.drain import STOPPED, Drain
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.operations.replica import ReplicaStatus, agent_line
from mlx_voicechat_plugin.testing.fixtures import question_signal

TIMEOUT = 20.0


def haproxy_reads(line: str) -> dict:
    """What HAProxy 2.x takes from an agent line: health, admin state, maxconn, description."""
    assert line.endswith("\n") and "\n" not in line[:-1] and "\r" not in line
    out: dict = {"health": None, "admin": None, "maxconn": None, "desc": None, "unknown": []}
    text = line[:-1]
    i = 0
    while i < len(text):
        if text[i] in " \t,":
            i += 1
            continue
        if text[i] == "#":  # a description only where a word starts
            out["desc"] = text[i + 1 :].lstrip(" \t")
            break
        j = i + 1
        while j < len(text) and text[j] not in " \t,":
            j += 1
        word = text[i:j].lower()
        if word in ("up", "down", "stopped", "fail"):
            out["health"] = word
        elif word in ("ready", "drain", "maint"):
            out["admin"] = word
        elif word.startswith("maxconn:"):
            out["maxconn"] = int(word[len("maxconn:"):])
        else:
            out["unknown"].append(word)
        i = j
    return out


def status(**fields) -> ReplicaStatus:
    base = dict(loaded=True, draining=False, failure=None, sessions=0, free=2)
    return ReplicaStatus(**{**base, **fields})


# --- the agent-check line ------------------------------------------------------------


def test_a_ready_replica_reports_up_ready_and_its_whole_capacity_as_maxconn():
    assert agent_line(status()) == "up ready maxconn:2\n"
    read = haproxy_reads(agent_line(status(sessions=1, free=1)))
    assert (read["health"], read["admin"], read["maxconn"]) == ("up", "ready", 2)
    assert not read["unknown"]


def test_a_full_replica_still_reports_its_capacity_never_maxconn_zero():
    # HAProxy counts its own connections against maxconn; 0 would mean no limit at all.
    assert haproxy_reads(agent_line(status(sessions=2, free=0)))["maxconn"] == 2
    assert haproxy_reads(agent_line(status(sessions=0, free=0)))["maxconn"] == 1


def test_a_loading_replica_is_down_with_a_reason_haproxy_reads():
    read = haproxy_reads(agent_line(status(loaded=False, free=1)))
    assert read["health"] == "down" and read["desc"] == "loading the model"
    assert not read["unknown"]


def test_down_needs_a_blank_before_the_sharp():
    # "down#reason" is one unknown word to HAProxy: the server would stay up.
    assert haproxy_reads("down#loading\n")["health"] is None


def test_a_failed_replica_is_down_with_its_error_on_one_printable_line():
    line = agent_line(status(failure="model failed to load: bad\r\nshape é" + "x" * 500))
    read = haproxy_reads(line)
    assert read["health"] == "down" and read["desc"].startswith("model failed to load: bad shape")
    assert len(line) < 200


def test_a_draining_replica_reports_drain_and_no_capacity():
    read = haproxy_reads(agent_line(status(draining=True, sessions=1, free=1)))
    assert (read["health"], read["admin"], read["maxconn"]) == (None, "drain", None)


def open_session_ledger(max_sessions: int = 3) -> ReservationLedger:
    """One open session reserving 40 bytes of state; a new one reserves at least 40."""
    ledger = ReservationLedger(max_sessions)
    ledger.reserved["open"], ledger.least, ledger.state_bytes = 40, 40, 10
    return ledger


class NoCounter:
    def inc(self) -> None:
        pass


def test_free_slots_count_the_slots_and_none_at_the_state_budget():
    admission = Admission(open_session_ledger(), NoCounter())
    assert admission.try_reserve("open")
    assert admission.free_slots() == 2
    admission.ledger.bound(3, 100)  # room for one more reservation of 40
    assert admission.free_slots() == 1
    admission.ledger.bound(3, 40)  # the open session's reservation is the whole budget
    assert admission.free_slots() == 0


def test_drain_seconds_must_not_be_negative():
    with pytest.raises(ValueError, match="drain_seconds"):
        Drain(object(), -1)


# --- a live replica ------------------------------------------------------------------------


def agent_says(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(256)
            assert chunk, data
            data += chunk
    return data.decode()


def start(tiny_ckpt, drain_seconds: float = 30.0, **limits) -> LiveServer:
    limits = ServerLimits(update_timeout=10, **limits)
    return LiveServer(create_app(tiny_ckpt, limits=limits, agent_port=0,
                                 drain_seconds=drain_seconds))


def begin_drain(live: LiveServer) -> Drain:
    drain = live.app.state.drain
    drain.loop.call_soon_threadsafe(drain.begin)
    deadline = time.monotonic() + TIMEOUT
    while not drain.draining:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return drain


def wait_stopped(drain: Drain, seconds: float = TIMEOUT) -> float:
    started = time.monotonic()
    while drain.state != STOPPED:
        assert time.monotonic() - started < seconds, drain.state
        time.sleep(0.01)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def replica(tiny_ckpt):
    yield from running(start(tiny_ckpt, max_sessions=2))


def test_the_agent_and_health_report_the_live_pool(replica):
    port = replica.app.state.agent.port
    assert agent_says(port) == "up ready maxconn:2\n"
    body = replica.wait_health(200)
    assert (body["ready"], body["draining"], body["sessions"], body["capacity"]) == \
        (True, False, 0, 2)
    with connect(replica.ws()) as ws:
        configure(ws)
        body = replica.health().json()
        assert (body["sessions"], body["free"], body["capacity"]) == (1, 1, 2)
        assert agent_says(port) == "up ready maxconn:2\n"
        send(ws, {"type": "session.cancel"})
        until_closed(ws)
    metrics = httpx.get(replica.http("/metrics"), timeout=5).text
    assert "voicechat_session_capacity 2.0" in metrics
    assert "voicechat_replica_ready 1.0" in metrics


def test_draining_refuses_new_sessions_and_lets_the_open_one_finish(tiny_ckpt):
    live = start(tiny_ckpt, max_sessions=2)
    try:
        audio = question_signal(0.4)
        with connect(live.ws()) as ws:
            configure(ws)
            drain = begin_drain(live)
            assert agent_says(live.app.state.agent.port) == "drain\n"
            health = live.health()
            assert health.status_code == 503
            assert health.json()["status"] == "draining" and health.json()["sessions"] == 1
            with connect(live.ws()) as refused:  # a free slot, but the replica is stopping
                assert "shutting down" in expect_error(refused, "server_busy")["error"]["message"]
                assert until_closed(refused)[1] == 1013
            transcription = httpx.post(
                live.http("/v1/audio/transcriptions"), files={"file": ("a.wav", b"x")},
                timeout=5)
            assert transcription.status_code == 503
            assert drain.state != STOPPED  # the open session holds it
            for start_at in range(0, len(audio), FRAME):
                send(ws, append_message(audio[start_at : start_at + FRAME]))
            send(ws, {"type": "input_audio_buffer.commit"})
            events, code = until_closed(ws)
        assert code == 1000 and events[-1]["type"] == "response.done"
        frames = -(-len(audio) // FRAME)
        assert sum(e["type"] == "response.audio.delta" for e in events) == frames
        wait_stopped(drain)
    finally:
        live.stop()


def test_sessions_open_past_the_drain_seconds_are_closed_with_1001_and_a_reason(tiny_ckpt):
    live = start(tiny_ckpt, drain_seconds=0.5)
    try:
        with connect(live.ws()) as ws:
            configure(ws)
            drain = begin_drain(live)
            waited = wait_stopped(drain)
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    recv(ws, 5)
        assert closed.value.rcvd.code == 1001
        assert "--drain-seconds 0.5" in closed.value.rcvd.reason
        assert waited < 5
    finally:
        live.stop()


def test_stop_now_closes_the_open_sessions_at_once(tiny_ckpt):
    live = start(tiny_ckpt, drain_seconds=300)
    try:
        with connect(live.ws()) as ws:
            configure(ws)
            drain = begin_drain(live)
            drain.loop.call_soon_threadsafe(drain.stop_now)
            wait_stopped(drain, 5)
            _, code = until_closed(ws, 5)
        assert code == 1001
    finally:
        live.stop()


def test_a_drained_serve_process_exits_0_after_its_last_session(tiny_ckpt, tmp_path):
    process = ServerProcess("mlx_voicechat_plugin.cli.main",
                            ["serve", "-m", str(tiny_ckpt), "--no-compile", "--max-sessions", "2",
                             "--drain-seconds", "60", "--log-level", "info"],
                            tmp_path / "serve.log")
    try:
        audio = question_signal(0.4)
        with connect(process.ws()) as ws:
            configure(ws)
            process.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + TIMEOUT
            while httpx.get(process.http("/health"), timeout=5).status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with connect(process.ws()) as refused:
                expect_error(refused, "server_busy")
                assert until_closed(refused)[1] == 1013
            assert process.process.poll() is None  # still serving the open session
            for start_at in range(0, len(audio), FRAME):
                send(ws, append_message(audio[start_at : start_at + FRAME]))
            send(ws, {"type": "input_audio_buffer.commit"})
            events, code = until_closed(ws)
            ended = time.monotonic()
        assert code == 1000 and events[-1]["type"] == "response.done"
        assert process.process.wait(TIMEOUT) == 0, process.output()
        assert time.monotonic() - ended < TIMEOUT
        assert "drained" in process.output()
    finally:
        process.stop()


def test_a_second_sigterm_stops_at_once(tiny_ckpt, tmp_path):
    process = ServerProcess("mlx_voicechat_plugin.cli.main",
                            ["serve", "-m", str(tiny_ckpt), "--no-compile",
                             "--drain-seconds", "300", "--log-level", "info"],
                            tmp_path / "serve.log")
    try:
        with connect(process.ws()) as ws:
            configure(ws)
            process.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert process.process.poll() is None  # draining: the session holds it
            process.process.send_signal(signal.SIGTERM)
            _, code = until_closed(ws, TIMEOUT)
        assert code == 1001
        assert process.process.wait(TIMEOUT) == 0, process.output()
    finally:
        process.stop()


class FakeEngine:
    """The engine attributes a replica's status reads."""

    max_sessions, max_state_bytes = 2, None
    ready, running, load_error = True, True, None

    def __init__(self) -> None:
        self.admission = Admission(open_session_ledger(self.max_sessions), NoCounter())
        self.admission.try_reserve("open")


def test_an_engine_whose_thread_stopped_is_down_and_its_health_500():
    from mlx_voicechat_plugin.server.operations.replica import health_response, replica_status

    engine = FakeEngine()
    assert replica_status(engine).ready
    engine.running = False
    state = replica_status(engine)
    assert not state.ready and state.free == 0
    read = haproxy_reads(agent_line(state))
    assert read["health"] == "down" and read["desc"] == "the engine thread stopped"
    assert health_response(state, "m", engine).status_code == 500


def test_a_draining_replica_has_no_free_slot_in_its_status():
    from mlx_voicechat_plugin.server.operations.replica import replica_status

    state = replica_status(FakeEngine(), draining=True)
    assert (state.sessions, state.free, state.capacity, state.ready) == (1, 0, 1, False)


def test_a_model_that_failed_to_load_is_down_with_the_error_on_agent_and_health(tiny_ckpt):
    from mlx_voicechat_plugin.server.engine import Engine

    def broken(path):
        raise RuntimeError("weights are missing")

    live = LiveServer(create_app(tiny_ckpt, engine=Engine(str(tiny_ckpt), broken),
                                 agent_port=0), wait_ready=False)
    try:
        body = live.wait_health(500)
        assert body["status"] == "error" and "weights are missing" in body["error"]
        assert body["ready"] is False and body["free"] == 0
        read = haproxy_reads(agent_says(live.app.state.agent.port))
        assert read["health"] == "down" and "weights are missing" in read["desc"]
    finally:
        live.stop()


def test_a_loading_replica_is_down_until_the_model_is_ready_then_up(tiny_ckpt):
    import threading

    from mlx_voicechat_plugin.server.engine import Engine, load_voicechat

    gate = threading.Event()

    def slow(path):
        gate.wait(TIMEOUT)
        return load_voicechat(path)

    live = LiveServer(create_app(tiny_ckpt, engine=Engine(str(tiny_ckpt), slow),
                                 agent_port=0), wait_ready=False)
    try:
        port = live.app.state.agent.port
        assert agent_says(port) == "down #loading the model\n"
        assert live.health().status_code == 503
        gate.set()
        live.wait_health(200)
        assert agent_says(port) == "up ready maxconn:1\n"
    finally:
        gate.set()
        live.stop()


@pytest.mark.parametrize("argv, message", [
    (["--agent-port", "0"], "--agent-port must be a TCP port"),
    (["--agent-port", "8080"], "--agent-port must differ from --port"),
    (["--drain-seconds", "-1"], "--drain-seconds must be >= 0"),
])
def test_serve_checks_the_replica_flags(argv, message, capsys):
    from mlx_voicechat_plugin.cli import serve

    with pytest.raises(SystemExit):
        serve.parse(["-m", "ckpt", *argv], "serve", False)
    assert message in capsys.readouterr().err


def test_serve_leaves_the_agent_off_and_drains_30_s_by_default():
    from mlx_voicechat_plugin.cli import serve

    args = serve.parse(["-m", "ckpt"], "serve", False)
    assert (args.agent_port, args.drain_seconds) == (None, 30.0)
