"""WebRTC calls and ephemeral keys refused, each for its own reason, with a clear error; after
each the server takes another call and nothing is left allocated (no session slot, no
reservation, no peer connection). The client peer gathers on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import struct
import sys
import time

import httpx
import pytest
from server_support import LiveServer, connect, recv, running

pytest.importorskip("aiortc")
import openai  # noqa: E402
from rtc_support import LOOPBACK, Caller  # noqa: E402
from websockets.exceptions import InvalidStatus  # noqa: E402

from mlx_voicechat_plugin.server.app import create_app  # noqa: E402
from mlx_voicechat_plugin.server.limits import ServerLimits  # noqa: E402
from mlx_voicechat_plugin.server.transport.ice import ICEConfig  # noqa: E402

API_KEY = "test-key"
CALLS = "/openai/v1/realtime/calls"
SECRETS = "/openai/v1/realtime/client_secrets"


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=10, idle_timeout=10, max_sessions=1)
    app = create_app(tiny_ckpt, api_key=API_KEY, limits=limits, ice=ICEConfig(hosts=LOOPBACK))
    yield from running(LiveServer(app))


def clean(server: LiveServer) -> None:
    """Nothing left: no call, no session slot or reservation."""
    app, deadline = server.app, time.monotonic() + 10
    while app.state.calls.open or app.state.calls.tasks \
            or app.state.engine.admission.sessions_in_use:
        assert time.monotonic() < deadline, "a call was left allocated"
        time.sleep(0.05)
    assert app.state.engine.admission.reserved_bytes == 0


async def created(server: LiveServer, key: str = API_KEY, hang_up: bool = True) -> Caller:
    """A call that reaches ``session.created`` (hung up unless told not to)."""
    caller = Caller(server.http("/openai/v1"), key)
    await caller.dial()
    await caller.until("session.created")
    if hang_up:
        await caller.hang_up()
        await caller.close()
    return caller


def another_call_works(server: LiveServer) -> None:
    clean(server)
    asyncio.run(created(server))
    clean(server)


def post(server: LiveServer, path: str, key: str | None = API_KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.http(path), headers={**headers, **kwargs.pop("headers", {})},
                      timeout=10, **kwargs)


def mint(server: LiveServer, **body) -> str:
    response = post(server, SECRETS, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["value"].startswith("ek_")
    return response.json()["value"]


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


def test_a_malformed_offer_is_a_400(server):
    for sdp in ("not an offer", "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF x\r\n"):
        response = post(server, CALLS, content=sdp,
                        headers={"Content-Type": "application/sdp"})
        assert "SDP offer" in error_of(response, 400)
    another_call_works(server)


def test_an_offer_with_no_audio_m_line_is_refused(server):
    async def dial() -> None:
        caller = Caller(server.http("/openai/v1"), API_KEY, audio=False)
        try:
            with pytest.raises(openai.BadRequestError, match="m=audio"):
                await caller.dial()
        finally:
            await caller.close()

    asyncio.run(dial())
    another_call_works(server)


def test_a_data_channel_message_that_is_not_json_is_an_error_and_the_call_goes_on(server):
    async def call() -> tuple[dict, dict]:
        caller = await created(server, hang_up=False)
        try:
            caller.send("this is not JSON")
            error = await caller.until("error")
            caller.send({"type": "session.update", "session": {"instructions": "Hi."}})
            updated = await caller.until("session.updated")
            await caller.hang_up()
            return error, updated
        finally:
            await caller.close()

    error, updated = asyncio.run(call())
    assert error["error"]["code"] == "invalid_request" and "JSON" in error["error"]["message"]
    assert updated["session"]["instructions"] == "Hi."
    another_call_works(server)


def test_a_call_over_max_sessions_is_a_429_and_allocates_nothing(server):
    async def calls() -> str:
        first = await created(server, hang_up=False)
        try:
            second = Caller(server.http("/openai/v1"), API_KEY)
            try:
                with pytest.raises(openai.RateLimitError) as refused:
                    await second.dial()
            finally:
                await second.close()
            assert len(server.app.state.calls.open) == 1
            assert server.app.state.engine.admission.sessions_in_use == 1
            await first.hang_up()
            return str(refused.value)
        finally:
            await first.close()

    assert "already active" in asyncio.run(calls())  # the WebSocket's server_busy reason
    another_call_works(server)


def test_a_wrong_key_is_a_401(server):
    assert "API key" in error_of(post(server, CALLS, key="wrong", content="v=0"), 401)
    assert "API key" in error_of(post(server, SECRETS, key="wrong", json={}), 401)
    another_call_works(server)


def test_an_ephemeral_key_opens_one_call_then_is_refused(server):
    key = mint(server, session={"type": "realtime", "instructions": "From the key."})
    caller = asyncio.run(created(server, key=key))
    assert caller.events[0]["type"] == "session.created"
    clean(server)
    with pytest.raises(openai.AuthenticationError, match="already used"):
        asyncio.run(created(server, key=key))
    another_call_works(server)


def test_an_ephemeral_key_starts_the_call_with_its_session(server):
    async def call() -> dict:
        caller = await created(server, key=mint(server, session={
            "type": "realtime", "instructions": "From the key."}), hang_up=False)
        try:
            updated = await caller.until("session.updated")
            await caller.hang_up()
            return updated
        finally:
            await caller.close()

    assert asyncio.run(call())["session"]["instructions"] == "From the key."
    clean(server)


def test_an_expired_ephemeral_key_is_refused(server, monkeypatch):
    key = mint(server, expires_after={"anchor": "created_at", "seconds": 10})
    keys = server.app.state.keys
    monkeypatch.setattr(keys, "clock", lambda: time.time() + 11)
    with pytest.raises(openai.AuthenticationError, match="expired"):
        asyncio.run(created(server, key=key))
    another_call_works(server)


def test_an_ephemeral_key_opens_the_ga_websocket_once(server):
    key = mint(server)
    url = server.ws("/openai/v1/realtime")
    with connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        assert recv(ws)["type"] == "session.created"
    clean(server)
    with pytest.raises(InvalidStatus) as refused:
        with connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{key}"]):
            pass
    assert refused.value.response.status_code == 401
    assert b"already used" in refused.value.response.body


def test_client_secrets_checks_its_request(server):
    seconds = post(server, SECRETS, json={"expires_after": {"seconds": 99999}})
    assert "expires_after.seconds" in error_of(seconds, 400)
    session = post(server, SECRETS, json={"session": {"type": "transcription"}})
    assert "session.type" in error_of(session, 400)
    answer = post(server, SECRETS, json={"expires_after": {"anchor": "created_at",
                                                           "seconds": 120}})
    assert answer.json()["expires_at"] - time.time() == pytest.approx(120, abs=5)


def test_hanging_up_an_unknown_call_is_a_404(server):
    assert "no open call" in error_of(httpx.delete(
        server.http(CALLS + "/rtc_nothing"), headers={"Authorization": f"Bearer {API_KEY}"}),
        404)


def test_without_aiortc_the_calls_route_is_a_501(tiny_ckpt, monkeypatch):
    from fastapi.testclient import TestClient

    monkeypatch.setitem(sys.modules, "mlx_voicechat_plugin.server.transport.webrtc", None)
    client = TestClient(create_app(tiny_ckpt, api_key=API_KEY))  # no lifespan: not loaded
    response = client.post(CALLS, content="v=0", headers={"Authorization": f"Bearer {API_KEY}"})
    assert "aiortc" in error_of(response, 501)


# --- a call's slot is free for the next call the moment it ends (issue 51) ----------

CALLS_IN_A_ROW = 6


async def calls(server: LiveServer, end: str) -> list[str]:
    """``CALLS_IN_A_ROW`` configured calls one after another, each ended by ``end`` (``hang_up``:
    the REST hang-up; ``drop``: the peer connection closes, no hang-up) and followed at
    once by the next; the refusals met."""
    refused = []
    for _ in range(CALLS_IN_A_ROW):
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


def test_a_refused_offer_ends_no_detached_session(server):
    """Issue 63, finding 5: a call that found the server full ended the longest-detached
    session before its offer was even read, though the offer was then refused."""
    from raw_client import RawClient
    from resume_support import event, resume_path, until

    auth = {"Authorization": f"Bearer {API_KEY}"}
    client = RawClient(server.port, "/openai/v1/realtime", headers=auth)
    token = event(client)["session"]["resume_token"]
    client.send_json({"type": "session.update", "session": {"type": "realtime"}})
    while (got := event(client))["type"] != "session.updated":
        assert got["type"] != "error", got
    client.close()  # dropped with no close frame: detached, holding the one slot
    resumes = server.app.state.resumes
    until(lambda: resumes.sessions[token].detached_or_claimed, "the detach")
    response = post(server, CALLS, content="not an offer",
                    headers={"Content-Type": "application/sdp"})
    assert "SDP offer" in error_of(response, 400)
    assert token in resumes.sessions and resumes.sessions[token].detached_or_claimed
    resumed = RawClient(server.port, resume_path("/openai/v1/realtime", token, got["seq"]),
                        headers=auth)
    assert event(resumed)["type"] == "session.resumed"
    resumed.send_frame(struct.pack("!H", 1000), opcode=0x8)  # a clean close ends it
    resumed.close_frame()
    resumed.close()
    until(lambda: server.app.state.engine.admission.reserved_bytes == 0, "the session's end")
    another_call_works(server)
