"""Short soak: sequential sessions leak no threads or fds; a model failure is survived."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
from server_support import (
    FRAME,
    FailingVoiceChat,
    LiveServer,
    append_message,
    configure,
    connect,
    recv,
    send,
)

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.engine import Engine, load_voicechat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.soak import one_session  # noqa: E402

SESSIONS = 15


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_sequential_sessions_do_not_grow_threads_or_fds(tiny_ckpt):
    server = LiveServer(create_app(tiny_ckpt))
    try:
        one_session(server)  # warm-up
        before = {t.name for t in threading.enumerate()}
        threads, fds = threading.active_count(), _fds()
        for _ in range(SESSIONS):
            assert one_session(server) >= 3
        deadline = time.monotonic() + 3.0  # client and connection threads finishing teardown
        while threading.active_count() > threads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= threads, \
            sorted({t.name for t in threading.enumerate()} - before)
        assert _fds() <= fds
    finally:
        server.stop()


def _fail_first_push():
    """A predicate true exactly once: the first stream's first push raises."""
    state = {"failed": False}

    def fails(stream) -> bool:
        first, state["failed"] = not state["failed"], True
        return first

    return fails


def test_the_engine_survives_a_model_exception_and_serves_the_next_session(tiny_ckpt):
    engine = Engine(
        str(tiny_ckpt), loader=lambda path: FailingVoiceChat(load_voicechat(path), _fail_first_push())
    )
    server = LiveServer(create_app(tiny_ckpt, engine=engine))
    try:
        with connect(server.ws()) as ws:
            configure(ws)
            send(ws, append_message(np.zeros(FRAME, np.float32)))
            event = recv(ws)
            assert event["type"] == "error" and event["error"]["code"] == "inference_error"
        for _ in range(3):
            assert one_session(server) >= 3
    finally:
        server.stop()
