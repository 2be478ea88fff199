"""Three replicas behind a real HAProxy (deploy/haproxy.cfg as shipped): spread, drain, failure.

Each replica is ``mlx-voicechat serve`` on the tiny fixture with
``--max-sessions N`` and ``--agent-port``; HAProxy reads their capacity from
the agent-check, and the test reads HAProxy's own view from its stats socket.
Loopback only: every port is free at run time and every address 127.0.0.1.
Every wait is bounded; timeouts allow for a loaded machine, assertions do not
depend on speed. Skipped (with the reason) when ``haproxy`` is not installed
(``make test`` installs it when CI is set).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from server_support import (
    FRAME,
    ServerProcess,
    append_message,
    as_received,
    configure,
    connect,
    free_ports,
    send,
    stop_process,
    until_closed,
)
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench import load as load_client
from mlx_voicechat_plugin.testing.fixtures import make_question_wav, question_signal

HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.path.exists(p)), None)
pytestmark = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy; make test "
                            "installs it when CI is set)")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "haproxy.cfg"
NAMES = ("replica1", "replica2", "replica3")
N = 2  # --max-sessions of each replica
WAIT = 30.0  # longest any one condition is waited for (a loaded 2-core machine)
CLIENT_TIMEOUT_S = 2  # HAProxy's client/server timeouts here; the tunnel's is far longer
QUEUE_TIMEOUT_S = 1


def until(condition, what: str, seconds: float = WAIT, every: float = 0.05) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


class Replica:
    """One ``mlx-voicechat serve`` process; restartable on the same ports."""

    def __init__(self, name: str, ckpt: Path, logs: Path, ports: tuple[int, int]):
        """``ports``: its serving port and its agent's, distinct from every other's."""
        self.name, self.ckpt, self.log = name, ckpt, logs / f"{name}.log"
        self.port, self.agent_port = ports
        self.process: ServerProcess | None = None

    def start(self) -> "Replica":
        self.process = ServerProcess(
            "mlx_voicechat_plugin.cli.main",
            ["serve", "-m", str(self.ckpt), "--max-sessions", str(N),
             "--agent-port", str(self.agent_port), "--drain-seconds", "60",
             "--log-level", "info"], self.log, port=self.port)
        return self

    @property
    def popen(self) -> subprocess.Popen:
        return self.process.process

    def health(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).json()

    def active_sessions(self) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
        line = next(l for l in text.splitlines() if l.startswith("voicechat_active_sessions "))
        return float(line.split()[1])


class Balancer:
    """``haproxy -f deploy/haproxy.cfg`` with this test's ports and short timeouts."""

    def __init__(self, replicas: list[Replica], logs: Path, port: int):
        self.port = port
        self.socket = logs / "haproxy.sock"
        env = {**os.environ, "HAPROXY_BIND": f"127.0.0.1:{self.port}",
               "HAPROXY_STATS_SOCKET": str(self.socket),
               "HAPROXY_TIMEOUT_CONNECT": "2s",
               "HAPROXY_TIMEOUT_CLIENT": f"{CLIENT_TIMEOUT_S}s",
               "HAPROXY_TIMEOUT_SERVER": f"{CLIENT_TIMEOUT_S}s",
               "HAPROXY_TIMEOUT_TUNNEL": "60s",
               "HAPROXY_TIMEOUT_QUEUE": f"{QUEUE_TIMEOUT_S}s",
               "HAPROXY_TIMEOUT_CHECK": "2s",
               "HAPROXY_CHECK_INTER": "200ms", "HAPROXY_AGENT_INTER": "200ms"}
        for i, replica in enumerate(replicas, 1):
            env[f"REPLICA{i}_ADDR"] = f"127.0.0.1:{replica.port}"
            env[f"REPLICA{i}_AGENT_PORT"] = str(replica.agent_port)
        self.log = logs / "haproxy.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen([HAPROXY, "-db", "-f", str(CONFIG)], env=env,
                                            stdout=out, stderr=subprocess.STDOUT)
        until(lambda: self.socket.exists() or self.process.poll() is not None, "haproxy")
        assert self.process.poll() is None, self.log.read_text()

    def ws(self, path: str = "/v1/realtime") -> str:
        return f"ws://127.0.0.1:{self.port}{path}"

    def stats(self) -> dict[str, dict[str, str]]:
        """``show stat`` of the realtime backend's servers: name -> columns."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.socket))
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
        return {r["svname"]: r for r in rows if r["pxname"] == "realtime" and r["svname"] in NAMES}

    def status(self, name: str) -> str:
        return self.stats()[name]["status"]

    def stop(self) -> None:
        stop_process(self.process)


@pytest.fixture(scope="module")
def cluster(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    *ports, balancer_port = free_ports(2 * len(NAMES) + 1)  # two a replica, one the balancer
    replicas = [Replica(name, tiny_ckpt, logs, (ports[2 * i], ports[2 * i + 1]))
                for i, name in enumerate(NAMES)]
    starters = [threading.Thread(target=r.start) for r in replicas]  # load side by side
    for thread in starters:
        thread.start()
    for thread in starters:
        thread.join(180)
    balancer = None
    try:
        assert all(r.process is not None for r in replicas), "a replica did not start"
        balancer = Balancer(replicas, logs, balancer_port)
        # Up, ready, and maxconn taken from each replica's agent.
        until(lambda: all(s["status"] == "UP" and s["slim"] == str(N)
                          for s in balancer.stats().values()), "replicas up with maxconn N")
        yield balancer, {r.name: r for r in replicas}
    finally:
        if balancer is not None:
            balancer.stop()
        for replica in replicas:
            if replica.process is not None:
                replica.process.stop()


class Session:
    """One client through the balancer: connected, configured, then fed and finished."""

    def __init__(self, url: str, seed: int):
        self.client = connect(url)
        self.ws = self.client.__enter__()
        self.replica = self.ws.response.headers.get("X-Voicechat-Replica")
        configure(self.ws, seed=seed)
        self.events: list[dict] = []
        self.code: int | None = None
        self.closed_at: float | None = None

    def stream(self, audio: np.ndarray, pace: float = 0.0) -> None:
        """Send the audio a frame a message (``pace`` seconds apart), commit, read to the end."""
        try:
            for start in range(0, len(audio), FRAME):
                send(self.ws, append_message(audio[start : start + FRAME]))
                time.sleep(pace)
            send(self.ws, {"type": "input_audio_buffer.commit"})
        except ConnectionClosed:
            pass
        self.finish()

    def finish(self) -> None:
        self.events, self.code = until_closed(self.ws, WAIT)
        self.closed_at = time.monotonic()
        self.client.__exit__(None, None, None)

    def cancel(self) -> None:
        send(self.ws, {"type": "session.cancel"})
        self.finish()

    def outputs(self) -> dict:
        def of(kind: str) -> list[dict]:
            return [e for e in self.events if e["type"] == kind]

        return {"text": [e["token_id"] for e in of("response.text.delta")],
                "function": [e["token_id"] for e in of("response.function.delta")],
                "codes": [e["audio_codes"] for e in of("response.audio.delta")]}


def audio_for(seconds: float) -> np.ndarray:
    return as_received(question_signal(seconds))


def settle(balancer: Balancer) -> None:
    """Every replica up and without sessions, as HAProxy sees them."""
    until(lambda: all(s["status"] == "UP" and s["scur"] == "0"
                      for s in balancer.stats().values()), "every replica up and idle")


def stopped_taking(status: str) -> bool:
    """HAProxy sends no new session to a server in this state."""
    return status in ("DRAIN", "MAINT") or status.startswith(("DOWN", "NOLB"))


def open_sessions(balancer: Balancer, count: int, seed: int = 0) -> list[Session]:
    return [Session(balancer.ws(), seed + i) for i in range(count)]


def refused_by_the_queue(balancer: Balancer) -> float:
    """A session past every replica's maxconn waits in HAProxy's queue, then gets a 503
    (never a replica's server_busy: HAProxy knew the capacity); the seconds it took."""
    started = time.monotonic()
    with pytest.raises(InvalidStatus) as refused:
        with connect(balancer.ws()) as ws:
            pytest.fail(f"admitted past the capacity: {until_closed(ws, WAIT)}")
    assert refused.value.response.status_code == 503
    return time.monotonic() - started


def by_replica(sessions: list[Session]) -> dict[str, int]:
    return {name: sum(s.replica == name for s in sessions) for name in NAMES}


def run_all(jobs: list) -> None:
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT * 2)
        assert not thread.is_alive(), "a client never finished"


def test_3n_sessions_land_n_per_replica_and_the_next_is_refused(cluster):
    balancer, replicas = cluster
    settle(balancer)
    sessions = open_sessions(balancer, 3 * N)
    try:
        assert by_replica(sessions) == {name: N for name in NAMES}
        stats = balancer.stats()
        assert {name: int(stats[name]["scur"]) for name in NAMES} == {name: N for name in NAMES}
        assert {name: r.active_sessions() for name, r in replicas.items()} == \
            {name: N for name in NAMES}
        waited = refused_by_the_queue(balancer)
        assert waited < QUEUE_TIMEOUT_S + WAIT
        print(f"spread: 503 after {waited:.2f} s in the queue (timeout queue "
              f"{QUEUE_TIMEOUT_S} s); load {os.getloadavg()}")
        assert all(r.health()["sessions"] <= N for r in replicas.values())
        assert all(int(s["smax"]) <= N for s in balancer.stats().values())
    finally:
        for session in sessions:
            session.cancel()
    assert all(s.code == 1000 for s in sessions)


def test_a_session_silent_past_the_client_and_server_timeouts_stays_open(cluster):
    balancer, _ = cluster
    settle(balancer)
    session = Session(balancer.ws(), 0)
    time.sleep(CLIENT_TIMEOUT_S * 1.5 + 0.5)  # the tunnel timeout (60 s) applies, not these
    session.stream(audio_for(0.3))
    assert session.code == 1000 and session.events[-1]["type"] == "response.done"


def stream_one_per_replica(balancer: Balancer, replicas: dict[str, Replica], audio: np.ndarray,
                           after: float, signum: int) -> tuple[list[Session], list[threading.Thread]]:
    """Sessions of seeds 0, 1, 2 (one per replica) streaming ``audio`` paced, each on
    its own thread; ``after`` seconds in, ``signum`` goes to the first session's replica."""
    sessions = open_sessions(balancer, 3)
    assert sorted(s.replica for s in sessions) == sorted(NAMES)
    clients = [threading.Thread(target=s.stream, args=(audio, 0.08), daemon=True)
               for s in sessions]
    for thread in clients:
        thread.start()
    time.sleep(after)
    replicas[sessions[0].replica].popen.send_signal(signum)
    return sessions, clients


def test_a_sigterm_drains_one_replica_while_the_others_take_new_sessions(cluster):
    balancer, replicas = cluster
    settle(balancer)
    audio = audio_for(1.6)  # 20 frames, paced: still streaming when the SIGTERM lands
    sessions, clients = stream_one_per_replica(balancer, replicas, audio, 0.3, signal.SIGTERM)
    signalled = time.monotonic()
    victim = sessions[0]
    replica = replicas[victim.replica]
    until(lambda: stopped_taking(balancer.status(victim.replica)), "HAProxy to see the drain")
    assert replica.popen.poll() is None  # still serving its session
    newcomers = open_sessions(balancer, 2, seed=10)
    try:
        assert all(s.replica != victim.replica for s in newcomers)
    finally:
        for session in newcomers:
            session.cancel()
    for thread in clients:
        thread.join(WAIT * 2)
    frames = -(-len(audio) // FRAME)
    for session in sessions:
        assert session.code == 1000
        assert session.events[-1]["type"] == "response.done"
        assert sum(e["type"] == "response.audio.delta" for e in session.events) == frames
    assert replica.popen.wait(WAIT) == 0, replica.log.read_text()[-2000:]
    exited = time.monotonic()
    assert exited >= victim.closed_at - 0.5  # it outlived its last session
    print(f"drain: its session closed {victim.closed_at - signalled:.2f} s after the SIGTERM, "
          f"exit 0 seen {exited - victim.closed_at:.2f} s later; load {os.getloadavg()}")
    replica.start()  # back for the next test
    until(lambda: balancer.status(victim.replica) == "UP", "the restarted replica up")


def test_a_killed_replica_fails_alone_and_takes_sessions_again_once_restarted(cluster):
    balancer, replicas = cluster
    settle(balancer)
    audio = audio_for(1.6)
    solo = {}
    for seed in range(3):  # each session's outputs run alone first
        session = Session(balancer.ws(), seed)
        session.stream(audio)
        assert session.code == 1000
        solo[seed] = session.outputs()
        assert solo[seed]["codes"] and solo[seed]["text"]
    settle(balancer)
    sessions, clients = stream_one_per_replica(balancer, replicas, audio, 0.4, signal.SIGKILL)
    killed = time.monotonic()
    victim = sessions[0]
    replica = replicas[victim.replica]
    clients[0].join(WAIT)
    assert victim.closed_at is not None and victim.code != 1000
    closed_after = victim.closed_at - killed
    assert closed_after < 10, closed_after
    down = until(lambda: stopped_taking(balancer.status(victim.replica)),
                 "HAProxy to mark the killed replica down") and time.monotonic() - killed
    for thread in clients[1:]:
        thread.join(WAIT * 2)
    for seed, session in enumerate(sessions[1:], 1):
        assert session.code == 1000 and session.events[-1]["type"] == "response.done"
        assert session.outputs() == solo[seed]
    holders = open_sessions(balancer, 2, seed=20)  # nothing goes to the dead one
    try:
        assert all(s.replica != victim.replica for s in holders)
        replica.popen.wait(5)
        replica.start()
        until(lambda: balancer.status(victim.replica) == "UP", "the restarted replica up")
        again = Session(balancer.ws(), 30)  # fewest sessions: leastconn picks it
        assert again.replica == victim.replica
        again.stream(audio_for(0.3))
        assert again.code == 1000
    finally:
        for session in holders:
            session.cancel()
    print(f"kill -9: client closed after {closed_after:.2f} s, HAProxy down after "
          f"{down:.2f} s; load {os.getloadavg()}")


def test_bench_load_through_the_balancer_reports_the_whole_deployment(cluster, tmp_path,
                                                                      capsys):
    balancer, replicas = cluster
    settle(balancer)
    wav = make_question_wav(tmp_path / "q.wav", seconds=0.5)
    out = tmp_path / "load.json"
    metrics = [f"http://127.0.0.1:{r.port}/metrics" for r in replicas.values()]
    load_client.main([str(wav), "--url", balancer.ws(), "--levels", str(3 * N), "--seconds",
                      "0.5", "--late-ms", "100000", "--json", str(out),
                      "--metrics-url", *metrics])
    level = json.loads(out.read_text())["levels"][0]
    assert level["streams"] == 3 * N and not level["errors"] and level["drops"] == 0
    assert level["steps"] > 0  # summed over the replicas' /metrics
    assert f"largest real-time N: {3 * N}" in capsys.readouterr().out
