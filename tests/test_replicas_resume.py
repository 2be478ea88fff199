"""Resuming behind a real HAProxy (deploy/haproxy.cfg as shipped) with two replicas.

Each replica names itself in its resume tokens (the server name HAProxy sends
with ``http-send-name-header``) and the config's ``use-server`` rules send a
resume back to it: a conversation dropped mid-answer and resumed through the
balancer reads as an undisturbed one, and a session not resumed within the
window is ended with its reservation freed. Skipped without ``haproxy``.
"""

from __future__ import annotations

import threading
import time

import pytest
from raw_client import RawClient
from resume_support import Conversation, abort, event, resume_path, stream
from server_support import FRAME, ServerProcess, append_message, free_ports
from test_replicas_haproxy import HAPROXY, Balancer, Replica, until

from mlx_voicechat_plugin.testing.fixtures import question_signal

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")

WINDOW_S = 3  # --resume-seconds of the replicas
FRAMES = 14
STATE_BUDGET = 1 << 30  # a budget, so each session's reservation is counted (/health)


class ResumableReplica(Replica):
    def start(self) -> "ResumableReplica":
        self.process = ServerProcess(
            "mlx_voicechat_plugin.cli.main",
            ["serve", "-m", str(self.ckpt), "--max-sessions", "2",
             "--max-state-bytes", str(STATE_BUDGET), "--agent-port",
             str(self.agent_port), "--resume-seconds", str(WINDOW_S), "--log-level", "info"],
            self.log, port=self.port)
        return self


@pytest.fixture(scope="module")
def pair(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("resume-replicas")
    *ports, balancer_port, down_port, down_agent_port = free_ports(7)
    replicas = [ResumableReplica(name, tiny_ckpt, logs, (ports[2 * i], ports[2 * i + 1]))
                for i, name in enumerate(("replica1", "replica2"))]
    starters = [threading.Thread(target=r.start) for r in replicas]
    for thread in starters:
        thread.start()
    for thread in starters:
        thread.join(180)
    monkeypatch = pytest.MonkeyPatch()
    # The shipped config's third server: an address where nothing listens (down).
    monkeypatch.setenv("REPLICA3_ADDR", f"127.0.0.1:{down_port}")
    monkeypatch.setenv("REPLICA3_AGENT_PORT", str(down_agent_port))
    balancer = None
    try:
        assert all(r.process is not None for r in replicas), "a replica did not start"
        balancer = Balancer(replicas, logs, balancer_port)
        until(lambda: all(balancer.stats()[r.name]["status"] == "UP" for r in replicas),
              "both replicas up")
        yield balancer, {r.name: r for r in replicas}
    finally:
        monkeypatch.undo()
        if balancer is not None:
            balancer.stop()
        for replica in replicas:
            if replica.process is not None:
                replica.process.stop()


def replica_of(client: RawClient) -> str:
    line = next(l for l in client.head.split("\r\n")
                if l.lower().startswith("x-voicechat-replica:"))
    return line.split(":", 1)[1].strip()


def test_a_resume_through_haproxy_reaches_the_replica_that_holds_the_session(pair):
    balancer, replicas = pair
    signal = question_signal(FRAMES * 0.08 + 0.1)
    undisturbed = Conversation(balancer.port, signal, None)
    undisturbed.start(seed=4)
    expected = stream(undisturbed.run(FRAMES))

    dropped = Conversation(balancer.port, signal, None)
    first = replica_of(dropped.client)
    dropped.start(seed=4)
    assert dropped.token.startswith(first + ".")
    events = dropped.run(FRAMES, drop_at=5)
    assert replica_of(dropped.client) == first
    assert len(dropped.resumes) == 1 and stream(events) == expected
    until(lambda: replicas[first].health()["sessions"] == 0, "the session's end")


def test_a_session_not_resumed_within_the_window_is_ended_and_its_reservation_freed(pair):
    balancer, replicas = pair
    client = RawClient(balancer.port)
    name = replica_of(client)
    created = event(client)
    client.send_json({"type": "session.update", "session": {}})
    assert event(client)["type"] == "session.updated"
    client.send_json(append_message(question_signal(0.2)[:FRAME]))
    abort(client)
    replica = replicas[name]
    until(lambda: replica.health()["sessions"] == 1, "the detached session")
    assert replica.health()["reserved_state_bytes"] > 0  # it still holds its reservation
    time.sleep(WINDOW_S)
    health = until(lambda: (h := replica.health())["sessions"] == 0 and h, "the window's end")
    assert health["reserved_state_bytes"] == 0
    with pytest.raises(AssertionError, match="410"):  # the session has ended
        RawClient(balancer.port, resume_path("/v1/realtime", created["session"]["resume_token"], 1))
