"""A WebRTC call's slot is free for the next call the moment it ends (issue 51): a caller
that hangs up and calls again at once, or whose peer connection closes mid call, is
never refused on a one-slot server. The client peer gathers on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import time

import pytest
from server_support import LiveServer, running

pytest.importorskip("aiortc")
import openai  # noqa: E402
from rtc_support import LOOPBACK, Caller  # noqa: E402

from mlx_voicechat_plugin.server.app import create_app  # noqa: E402
from mlx_voicechat_plugin.server.limits import ServerLimits  # noqa: E402
from mlx_voicechat_plugin.server.transport.ice import ICEConfig  # noqa: E402

API_KEY = "test-key"
CALLS = 6


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=10, idle_timeout=10, max_sessions=1)
    app = create_app(tiny_ckpt, api_key=API_KEY, limits=limits, ice=ICEConfig(hosts=LOOPBACK))
    yield from running(LiveServer(app))


def clean(server: LiveServer) -> None:
    app, deadline = server.app, time.monotonic() + 10
    while app.state.calls.open or app.state.calls.tasks \
            or app.state.engine.admission.sessions_in_use:
        assert time.monotonic() < deadline, "a call was left allocated"
        time.sleep(0.05)


async def calls(server: LiveServer, end: str) -> list[str]:
    """``CALLS`` configured calls one after another, each ended by ``end`` (``hang_up``:
    the REST hang-up; ``drop``: the peer connection closes, no hang-up) and followed at
    once by the next; the refusals met."""
    refused = []
    for _ in range(CALLS):
        caller = Caller(server.http("/openai/v1"), API_KEY)
        try:
            try:
                await caller.dial()
            except openai.APIStatusError as exc:
                refused.append(f"{exc.status_code}: {exc.message}")
                continue
            await caller.until("session.created")
            caller.send({"type": "session.update", "session": {"type": "realtime"}})
            await caller.until("session.updated")
            if end == "hang_up":
                await caller.hang_up()
        finally:
            await caller.close()
    return refused


@pytest.mark.parametrize("end", ["hang_up", "drop"])
def test_a_caller_that_ends_a_call_and_calls_again_at_once_is_never_refused(server, end):
    clean(server)
    assert asyncio.run(calls(server, end)) == []
    clean(server)
