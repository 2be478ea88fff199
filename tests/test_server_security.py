"""Security: no client-chosen paths, constant-time key checks.

Covered elsewhere (not repeated): the Origin policy on the upgrade
(``test_server_http.py::test_an_upgrade_from_a_foreign_origin_is_refused_with_403``,
``test_allowed_origins_and_non_browser_clients_connect``), and logs holding
neither audio nor the API key at DEBUG over a full session
(``test_server_http.py::test_logs_hold_neither_audio_nor_the_api_key``).
"""

from __future__ import annotations

import numpy as np
import pytest
from server_support import FRAME, LiveServer, append_message, configure, connect, send, until_closed

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.engine import Engine, load_voicechat
from mlx_voicechat_plugin.server.routes import access as app_module
from mlx_voicechat_plugin.server.routes.access import bearer_ok


@pytest.mark.parametrize("model", ["/etc/passwd", "../../other/ckpt", "nvidia/another-model",
                                   {"path": "/tmp"}])
def test_session_model_never_makes_the_server_load_anything(tiny_ckpt, model):
    loaded: list[str] = []

    def counting_loader(path):
        loaded.append(path)
        return load_voicechat(path)

    server = LiveServer(create_app(tiny_ckpt, engine=Engine(str(tiny_ckpt), counting_loader)))
    try:
        with connect(server.ws()) as ws:
            updated = configure(ws, model=model)
            assert updated["session"]["model"] == "tiny"
            send(ws, append_message(np.zeros(FRAME, np.float32)))
            send(ws, {"type": "input_audio_buffer.commit"})
            assert until_closed(ws)[1] == 1000
    finally:
        server.stop()
    assert loaded == [str(tiny_ckpt)]


def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = app_module.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    assert bearer_ok("Bearer secret", "secret")
    assert not bearer_ok("Bearer guess", "secret")
    assert calls == [(b"secret", b"secret"), (b"guess", b"secret")]


@pytest.mark.parametrize("header", [None, "", "secret", "Basic secret", "Bearer", "Bearer secre"])
def test_anything_but_the_exact_bearer_key_is_refused(header):
    assert not bearer_ok(header, "secret")
