"""Admission: one session at a time, and the slot is freed however the holder leaves."""

from __future__ import annotations


import numpy as np
import pytest
from raw_client import RawClient
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    configure,
    connect,
    connect_storm,
    running,
    send,
    until_closed,
)

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits

CLIENTS = 50


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=5, idle_timeout=5)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits)))


def _admitted(server) -> None:
    server.wait_idle()
    with connect(server.ws()) as ws:
        configure(ws)
        send(ws, {"type": "session.cancel"})
        assert until_closed(ws)[1] == 1000


def test_fifty_simultaneous_clients_get_one_session_and_49_busy_closes(server):
    server.wait_idle()
    results = connect_storm(server, CLIENTS, 1)
    assert len(results) == CLIENTS
    assert results.count(("created", None)) == 1
    assert results.count(("server_busy", 1013)) == CLIENTS - 1
    _admitted(server)


@pytest.mark.parametrize("ending", ["session.cancel", "input_audio_buffer.commit"])
def test_the_next_client_is_admitted_after_the_holder_ends_its_session(server, ending):
    server.wait_idle()
    with connect(server.ws()) as ws:
        configure(ws)
        send(ws, append_message(np.zeros(2 * FRAME, np.float32)))
        send(ws, {"type": ending})
        assert until_closed(ws)[1] == 1000
    _admitted(server)


@pytest.mark.parametrize("moment", ["before-update", "mid-append", "mid-flush"])
def test_the_next_client_is_admitted_after_the_holder_drops_its_tcp_connection(server, moment):
    server.wait_idle()
    client = RawClient(server.port)
    if moment != "before-update":
        client.send_json({"type": "session.update", "session": {}})
        client.send_json(append_message(np.zeros(20 * FRAME, np.float32)))
    if moment == "mid-flush":
        client.send_json({"type": "input_audio_buffer.commit"})
    client.close()  # no close frame: the TCP connection just goes
    _admitted(server)
