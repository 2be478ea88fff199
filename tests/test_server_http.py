"""HTTP side of the server: health, 501 routes, API key, Origin, prefix, logs, CLI."""

from __future__ import annotations

import logging
import threading

import httpx
import numpy as np
import pytest
from server_support import (
    FRAME,
    LiveServer,
    ServerProcess,
    append_message,
    configure,
    connect,
    expect_error,
    running,
    send,
    until_closed,
)
from websockets.exceptions import InvalidStatus

from mlx_voicechat_plugin.cli import serve
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.engine import Engine, load_voicechat
from mlx_voicechat_plugin.server.limits import ServerLimits

API_KEY = "sk-test-very-secret-key"
ALLOWED = "http://allowed.example"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    app = create_app(tiny_ckpt, alias="served-voicechat", api_key=API_KEY, api_prefix="/api",
                     allowed_origins=[ALLOWED], limits=ServerLimits(update_timeout=5))
    live = LiveServer(app, wait_ready=False)
    live.wait_health(200, "/api/health")
    yield from running(live)


def url(server, path="/v1/realtime"):
    return server.ws("/api" + path)


def rejected_status(server, **kwargs) -> int:
    with pytest.raises(InvalidStatus) as caught:
        with connect(url(server), **kwargs):
            pass
    return caught.value.response.status_code


def test_health_reports_the_served_model_under_the_prefix(server):
    body = server.health("/api/health").json()
    assert body["status"] == "ok" and body["model"] == "served-voicechat"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                  "/v1/messages"])
def test_text_routes_answer_501_naming_the_realtime_route(server, path):
    response = httpx.post(server.http("/api" + path), json={}, timeout=5)
    assert response.status_code == 501
    assert "/v1/realtime" in response.json()["error"]["message"]


def test_an_upgrade_without_the_api_key_is_refused_with_401(server):
    assert rejected_status(server) == 401


def test_an_upgrade_with_a_wrong_api_key_is_refused_with_401(server):
    assert rejected_status(server, additional_headers={"Authorization": "Bearer nope"}) == 401


def test_an_upgrade_from_a_foreign_origin_is_refused_with_403(server):
    assert rejected_status(server, additional_headers=AUTH, origin="http://evil.example") == 403


@pytest.mark.parametrize("origin", [ALLOWED, None])
def test_allowed_origins_and_non_browser_clients_connect(server, origin):
    server.wait_idle("/api/health")
    with connect(url(server), additional_headers=AUTH, origin=origin) as ws:
        updated = configure(ws, model="anything")
        assert updated["session"]["model"] == "served-voicechat"
        send(ws, {"type": "session.cancel"})
        assert until_closed(ws)[1] == 1000


def test_the_realtime_route_lives_only_under_the_prefix(server):
    with pytest.raises(InvalidStatus):
        with connect(server.ws("/v1/realtime"), additional_headers=AUTH):
            pass


def test_logs_hold_neither_audio_nor_the_api_key(server, caplog):
    server.wait_idle("/api/health")
    caplog.set_level(logging.DEBUG)
    message = append_message(np.full(FRAME, 0.25, np.float32))
    with connect(url(server), additional_headers=AUTH) as ws:
        configure(ws)
        send(ws, message)
        send(ws, {"type": "input_audio_buffer.commit"})
        events, _ = until_closed(ws)
    audio_out = [e["delta"] for e in events if e["type"] == "response.audio.delta"]
    with pytest.raises(InvalidStatus):
        with connect(url(server), additional_headers={"Authorization": f"Bearer {API_KEY}x"}):
            pass
    # The server's own loggers; the test's client library logs its own frames.
    text = "\n".join(r.getMessage() for r in caplog.records
                     if r.name.startswith(("mlx_voicechat_plugin", "uvicorn", "fastapi")))
    assert "rejected upgrade" in text and "configured" in text
    assert API_KEY not in text
    assert message["audio"][:64] not in text
    assert all(chunk[:64] not in text for chunk in audio_out)


def test_health_is_503_and_clients_are_busy_until_the_model_has_loaded(tiny_ckpt):
    gate = threading.Event()

    def slow_loader(path):
        gate.wait(10)
        return load_voicechat(path)

    live = LiveServer(create_app(tiny_ckpt, engine=Engine(str(tiny_ckpt), slow_loader)),
                      wait_ready=False)
    try:
        assert live.health().status_code == 503
        with connect(live.ws()) as ws:
            expect_error(ws, "server_busy")
            assert until_closed(ws)[1] == 1013
        gate.set()
        assert live.wait_health(200)["model"] == "tiny"
    finally:
        gate.set()
        live.stop()


def test_serve_parses_flags_into_limits():
    args = serve.parse(["-m", "ckpt", "--max-message-bytes", "1000", "--max-session-seconds", "5",
                        "--update-timeout", "1", "--idle-timeout", "2",
                        "--cors-origins", "http://a.example,http://b.example"], "serve", False)
    assert args.limits == ServerLimits(1000, 5.0, 1.0, 2.0)
    assert (args.host, args.port) == ("127.0.0.1", 8080)
    assert serve._origins(args.origins) == ["http://a.example", "http://b.example"]


def test_serve_defaults_follow_the_protocol():
    args = serve.parse(["-m", "ckpt"], "serve", False)
    assert args.limits == ServerLimits(1 << 20, 600.0, 30.0, 120.0)


def test_serve_tolerates_host_flags_only_when_asked():
    assert serve.parse(["-m", "ckpt", "--trust-remote-code"], "host", True).model == "ckpt"
    with pytest.raises(SystemExit):
        serve.parse(["-m", "ckpt", "--trust-remote-code"], "serve", False)


@pytest.mark.parametrize("command", [["mlx_voicechat_plugin.cli.main", "serve"],
                                     ["mlx_vlm.server", "--trust-remote-code"]],
                         ids=["mlx-voicechat-serve", "mlx_vlm.server"])
def test_the_serve_command_runs_a_real_server(tiny_ckpt, command, tmp_path):
    server = ServerProcess(command[0], [*command[1:], "-m", str(tiny_ckpt),
                                        "--log-level", "warning"], tmp_path / "server.log")
    try:
        with connect(server.ws()) as ws:
            configure(ws)
            send(ws, {"type": "input_audio_buffer.commit"})
            assert until_closed(ws)[1] == 1000
    finally:
        server.stop()
