"""Hostile clients, round three: what a client makes the server keep is bounded in bytes,
no client's message holds the event loop, a minted session binds every connection, and
no input is a 500. Each test failed on the code before the fix (issue 63's finding in
its docstring); all go through real sockets to a server with an API key.
"""

from __future__ import annotations

import asyncio
import json
import re
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from raw_client import RawClient
from resume_support import abort, event
from server_support import (
    LiveServer,
    ServerProcess,
    connect,
    expect_error,
    recv,
    running,
    send,
)
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.victim_gap import QUIET, Attacker, run_windows, window_figures
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import MIB, ServerLimits

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GA = "/openai/v1/realtime"
SECRETS = GA + "/client_secrets"
# A message of a million-odd empty objects, just under the 1 MiB message limit: ~1 KiB
# on the wire with permessage-deflate, ~24 MiB as parsed JSON.
EMPTIES = 340_000


def empties_item(index: int) -> str:
    """An item of a million-odd empty objects, just under the 1 MiB message limit."""
    return json.dumps({"type": "conversation.item.create",
                       "item": {"id": f"item_flood{index}", "type": "message", "role": "user",
                                "content": [{}] * EMPTIES}}, separators=(",", ":"))


def text_item(index: int) -> str:
    """An item of one string, just under the 1 MiB message limit."""
    return json.dumps({"type": "conversation.item.create",
                       "item": {"id": f"item_flood{index}", "type": "message", "role": "user",
                                "content": [{"type": "input_text",
                                             "text": "x" * (MIB - 4096)}]}})


def until_type(ws, *kinds: str) -> dict:
    while True:
        event = recv(ws, 60)
        if event["type"] in kinds:
            return event


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(max_item_bytes=MIB, max_minted_bytes=MIB)
    app = create_app(tiny_ckpt, api_key=API_KEY, limits=limits)
    yield from running(LiveServer(app, ws_max_size=limits.transport_max_bytes))


@pytest.fixture(scope="module")
def process(tiny_ckpt, tmp_path_factory):
    """``mlx-voicechat serve`` as deployed (its own process, so its RSS and its CPU are
    its own), with room for two sessions."""
    served = ServerProcess("mlx_voicechat_plugin.cli.main",
                           ["serve", "-m", str(tiny_ckpt), "--no-compile",
                            "--api-key", API_KEY, "--log-level", "warning",
                            "--max-sessions", "2"],
                           tmp_path_factory.mktemp("serve") / "serve.log")
    yield served
    served.stop()


# --- 1: items and the replay log bounded in bytes --------------------------------------


@pytest.mark.parametrize("item", [empties_item, text_item], ids=["empties", "text"])
@pytest.mark.parametrize("compression", ["deflate", None], ids=["deflate", "plain"])
def test_an_item_flood_leaves_the_servers_memory_flat(process, compression, item):
    """Finding 1: 75 items of 1 MiB of ``{}`` took the server from 229 to 1,998 MiB. A
    message of more than 20,000 JSON values is refused before the server keeps or echoes
    it; items and their echoes in the replay log are kept as bytes within their budgets
    (4 MiB of items, 8 MiB of replay). RSS stays within 150 MiB of where it was after
    three such messages, with and without permessage-deflate."""
    with connect(process.ws(GA), additional_headers=AUTH, compression=compression) as ws:
        assert recv(ws)["type"] == "session.created"

        def flood(indices: range) -> None:
            for index in indices:
                send(ws, item(index))
                until_type(ws, "conversation.item.done", "error")
                send(ws, {"type": "conversation.item.delete", "item_id": f"item_flood{index}"})
                until_type(ws, "conversation.item.deleted")

        flood(range(3))  # the allocator's arenas for a message's parse
        start = rss_mib(process.process.pid)
        flood(range(3, 33))
        grown = rss_mib(process.process.pid) - start
        send(ws, {"type": "conversation.item.create", "item": {
            "id": "item_after", "type": "message", "role": "user", "content": []}})
        assert until_type(ws, "conversation.item.done")["item"]["id"] == "item_after"
    assert grown < 150, f"RSS grew {grown:.0f} MiB under the item flood"


def peak_rss(pid: int, stop: threading.Event, peak: list[float]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], rss_mib(pid))
        time.sleep(0.02)


NOT_READ_ITEMS = 40  # ~80 MiB of item echoes: far past the 8 MiB bound, inside 256 events


def test_a_client_that_never_reads_its_echoes_is_closed_past_the_pending_bytes(process):
    """The outbox counted events, not bytes: a client sending 1 MiB items and reading
    nothing made the server queue up to 256 echoes of ~1 MiB. Past ``--max-pending-bytes``
    (8 MiB) of unsent events it is closed (1008 "client is not reading"), and the
    server's RSS peaks within 64 MiB of where it was."""
    with connect(process.ws(GA), additional_headers=AUTH) as ws:  # the parse's arenas
        assert recv(ws)["type"] == "session.created"
        for index in range(3):
            send(ws, text_item(index))
            until_type(ws, "conversation.item.done")
            send(ws, {"type": "conversation.item.delete", "item_id": f"item_flood{index}"})
            until_type(ws, "conversation.item.deleted")
    pid = process.process.pid
    start, peak, stop = rss_mib(pid), [0.0], threading.Event()
    sampler = threading.Thread(target=peak_rss, args=(pid, stop, peak), daemon=True)
    client = RawClient(process.port, GA, headers=AUTH)
    sampler.start()
    try:
        for index in range(NOT_READ_ITEMS):
            try:
                client.send_frame(text_item(index).encode())
                client.send_json({"type": "conversation.item.delete",
                                  "item_id": f"item_flood{index}"})
            except OSError:  # the server has closed it
                break
        # Now read: the connection ends (its close frame, or a reset once the close
        # frame waited 2 s) rather than waiting for more.
        closing: tuple[int, str] | None = None
        client.sock.settimeout(30)
        try:
            while True:
                opcode, payload = client.read_frame()
                if opcode == 0x8:
                    closing = struct.unpack("!H", payload[:2])[0], payload[2:].decode()
                    break
        except (EOFError, ConnectionResetError):
            pass
    finally:
        stop.set()
        sampler.join()
        client.close()
    assert closing is None or closing == (1008, "client is not reading"), closing
    grown = peak[0] - start
    assert grown < 64, f"RSS peaked {grown:.0f} MiB above the start"


def test_a_message_of_a_million_values_is_refused_and_the_session_goes_on(server):
    """Finding 1 and 4: what a message's JSON costs the server follows its values, not
    its bytes; past 20,000 values it is an ``invalid_request`` (parsed off the loop)."""
    with connect(server.ws(GA), additional_headers=AUTH) as ws:
        assert recv(ws)["type"] == "session.created"
        send(ws, empties_item(0))
        assert "20000 JSON values" in expect_error(ws, "invalid_request")["error"]["message"]
        send(ws, {"type": "conversation.item.retrieve", "item_id": "item_flood0"})
        expect_error(ws, "item_retrieve_invalid_item_id")


def test_the_message_cap_counts_decompressed_bytes(server):
    """Finding 1: permessage-deflate made 1 MiB of ``{}`` cost ~1 KiB on the wire; the
    transport's cap (``--max-message-bytes`` + 64 KiB) applies to the message as
    decompressed: 2 MiB of one letter (~2 KiB on the wire) is closed 1009."""
    with connect(server.ws(GA), additional_headers=AUTH, compression="deflate") as ws:
        assert recv(ws)["type"] == "session.created"
        assert "permessage-deflate" in ws.response.headers.get("Sec-WebSocket-Extensions", "")
        ws.send('{"type":"x","pad":"' + "x" * (2 * MIB) + '"}')
        with pytest.raises(ConnectionClosed) as closed:
            recv(ws)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


def test_an_item_past_the_budget_is_an_error_and_the_session_keeps_its_items(server):
    """Finding 1: items were kept up to 4,096 of any size; past ``--max-item-bytes`` a
    client's item is an ``invalid_request`` naming the flag, and nothing kept changes."""
    big = "x" * (400 * 1024)
    with connect(server.ws(GA), additional_headers=AUTH) as ws:
        assert recv(ws)["type"] == "session.created"
        for index in range(2):
            send(ws, {"type": "conversation.item.create", "item": {
                "id": f"item_{index}", "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": big}]}})
            until_type(ws, "conversation.item.done")
        send(ws, {"type": "conversation.item.create", "item": {
            "id": "item_2", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": big}]}})
        assert "--max-item-bytes" in expect_error(ws, "invalid_request")["error"]["message"]
        send(ws, {"type": "conversation.item.retrieve", "item_id": "item_0"})
        assert recv(ws)["item"]["content"][0]["text"] == big
        send(ws, {"type": "conversation.item.delete", "item_id": "item_0"})
        until_type(ws, "conversation.item.deleted")
        send(ws, {"type": "conversation.item.create", "item": {
            "id": "item_2", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": big}]}})
        assert until_type(ws, "conversation.item.done", "error")["type"] \
            == "conversation.item.done"


# --- 4: no client's message holds the loop -----------------------------------------------

ATTACKER = textwrap.dedent("""
    import json, sys
    from websockets.sync.client import connect
    url, key, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    empties = ",".join(["{}"] * 340000)
    text = '{"type":"input_text","text":"' + "x" * (1024 * 1024 - 4096) + '"}'
    with connect(url, additional_headers={"Authorization": "Bearer " + key},
                 max_size=None, open_timeout=30) as ws:
        ws.recv(timeout=30)
        for index in range(count):
            ws.send('{"type":"conversation.item.create","item":{"id":"item_a%d",'
                    '"type":"message","role":"user","content":[%s]}}'
                    % (index, empties if index % 2 else text))
            while json.loads(ws.recv(timeout=60))["type"] not in ("conversation.item.done",
                                                                   "error"):
                pass
            ws.send(json.dumps({"type": "conversation.item.delete",
                                "item_id": "item_a%d" % index}))
            while json.loads(ws.recv(timeout=60))["type"] != "conversation.item.deleted":
                pass
    print("sent", count)
""")


def test_one_clients_megabyte_messages_never_hold_the_loop_past_200_ms(server):
    """Finding 4: a 1 MiB message of empty objects held the loop ~0.65 s (its depth
    check, on the loop, then its echoes), stalling every other session's audio; now long
    messages are parsed, and long items written out, in a worker thread, and one of
    more than 20,000 values goes no further. The measure is what the server's loop
    thread itself spends between two wakes of a 10 ms timer on it (its CPU time: what
    every other session's events wait behind, not the machine's load, which other
    processes share) while another process sends 1 MiB messages, of empty objects and
    of text in turn; the bound is 200 ms (before the fix: 380 ms and more)."""
    lags: list[float] = []
    stop = threading.Event()

    async def probe() -> None:  # on the server's loop: the loop thread's CPU time
        while not stop.is_set():
            began = time.thread_time()
            await asyncio.sleep(0.01)
            lags.append(time.thread_time() - began)

    task = asyncio.run_coroutine_threadsafe(probe(), server.app.state.drain.loop)
    try:
        attacker = subprocess.run(
            [sys.executable, "-c", ATTACKER, server.ws(GA), API_KEY, "8"],
            capture_output=True, text=True, timeout=300)
    finally:
        stop.set()
        task.result(10)
    assert attacker.returncode == 0, attacker.stderr[-2000:]
    assert len(lags) > 20
    assert max(lags) < 0.2, f"the loop stalled {max(lags) * 1000:.0f} ms"


ATTACK_WINDOWS = 8  # each between two quiet ones
WINDOW_SECONDS = 1.5


def test_one_clients_megabyte_messages_add_under_200_ms_to_a_victims_worst_audio_gap(process):
    """Finding 4, as the acceptance says it: another session's audio stalled up to 1.8 s
    while a client sent 1 MiB messages of empty objects. A victim streams 80 ms frames in
    real time to ``serve`` (its own process) while, in 1.5 s windows that alternate, an
    attacker process sends such messages with permessage-deflate, each as soon as the
    last is answered, or sends nothing. On a shared machine a quiet window's worst gap
    between two audio deltas alone ranges from under 100 ms to over 1 s, so the windows
    the machine disturbed least are compared: the least-disturbed attack window's worst
    gap is under 200 ms above the least-disturbed quiet window's. A loop held by each
    message (0.65 s and more before the fix) shows in every attack window; the machine's
    noise would have to hit all eight to fail the rule (``bench.victim_gap`` measures it
    with more attackers and windows)."""
    attacker = Attacker(process.ws(GA), API_KEY, "deflate")
    try:
        plan = [(QUIET, [])] + [step for _ in range(ATTACK_WINDOWS)
                                for step in (("attack", [attacker]), (QUIET, []))]
        windows, victim = run_windows(process.ws("/v1/realtime"), AUTH, plan, WINDOW_SECONDS)
    finally:
        attacker.close()
    assert victim.drops == 0
    rows = [window_figures(window, victim) for window in windows]
    attacked = [row for row in rows if row["window"] != QUIET]
    quiet = [row for row in rows if row["window"] == QUIET]
    assert len(attacked) == ATTACK_WINDOWS and all(row["messages"] > 0 for row in attacked)
    worst = {name: sorted(round(row["gap_max_ms"]) for row in group)
             for name, group in (("attack", attacked), ("quiet", quiet))}
    added = worst["attack"][0] - worst["quiet"][0]
    assert added < 200, f"the attack added {added} ms to the victim's worst gap: {worst}"


def wav(code: int = 1, rate: int = 16_000, data: bytes = b"\0\0" * 20) -> bytes:
    fmt = struct.pack("<HHIIHH", code, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" \
        + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def transcribe(server: LiveServer, data: bytes) -> httpx.Response:
    return httpx.post(server.http("/v1/audio/transcriptions"), headers=AUTH,
                      files={"file": ("a.wav", data, "audio/wav")}, timeout=60)


@pytest.mark.parametrize("rate", [1, 7_999, 384_001, 0])
def test_an_upload_declaring_a_rate_outside_the_formats_is_a_400_before_decoding(server, rate):
    """Finding 4: an 84-byte WAV whose header says 1 Hz cost 24.6 s of CPU in the
    resampler; a declared rate outside 8 kHz to 384 kHz is refused at once."""
    began = time.monotonic()
    response = transcribe(server, wav(rate=rate))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "file"
    assert "Hz" in response.json()["error"]["message"] or rate == 0
    assert time.monotonic() - began < 10


# --- 7: minted sessions kept as bytes, within a budget ---------------------------------


def mint(server: LiveServer, **body) -> httpx.Response:
    return httpx.post(server.http(SECRETS), headers=AUTH, json=body, timeout=30)


def test_minted_sessions_are_kept_as_bytes_within_their_budget(server):
    """Finding 7: each mint with a 250 KiB session kept ~4.9 MiB of parsed tree, 1,024
    of them; now the session's JSON is kept and the keys' sessions together stay within
    ``--max-minted-bytes`` (1 MiB here): past it a mint is a 429 that names the flag."""
    keys = server.app.state.keys
    session = {"type": "realtime", "instructions": "", "tools": [
        {"type": "function", "name": "f", "description": "", "parameters": {
            "type": "object", "properties": {}, "x": [{}] * (80 * 1024)}}]}
    answers = [mint(server, session=session) for _ in range(8)]
    statuses = [a.status_code for a in answers]
    assert 200 in statuses and statuses[-1] == 429, statuses
    assert "--max-minted-bytes" in answers[-1].json()["error"]["message"]
    assert keys.bytes <= MIB
    assert all(isinstance(k.session_json, bytes) for k in keys.keys.values())
    with keys.lock:  # spend the budget again for the tests after this one
        keys.keys.clear()
        keys.bytes = 0


# --- 9: a minted session binds the WebSocket too -------------------------------------------


def test_a_websocket_opened_with_a_minted_key_starts_with_its_session_and_keeps_it(server):
    """Finding 9: a WebSocket opened with a key minted with instructions started empty;
    it starts with the key's session (as a WebRTC call does) and cannot drop what the
    backend fixed."""
    key = mint(server, session={"type": "realtime", "instructions": "From the backend."})
    key = key.json()["value"]
    with connect(server.ws(GA), subprotocols=["realtime", f"openai-insecure-api-key.{key}"]) \
            as ws:
        assert recv(ws)["type"] == "session.created"
        updated = until_type(ws, "session.updated", "error")
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["instructions"] == "From the backend."
        send(ws, {"type": "session.update", "session": {"instructions": "Ignore that."}})
        error = until_type(ws, "error", "session.updated")
        assert error["type"] == "error" and "instructions" in error["error"]["message"]
        send(ws, {"type": "session.update", "session": {"instructions": "From the backend.",
                                                        "output_modalities": ["audio"]}})
        assert until_type(ws, "session.updated", "error")["type"] == "session.updated"


@pytest.mark.parametrize("path", ["/v1/realtime", "/nvidia/v1/realtime",
                                  "/openai/v1/live/sessions"])
def test_a_key_minted_with_a_session_opens_no_other_dialect(server, path):
    """Finding 9: the session would not bind there; the upgrade is a 403 saying where."""
    key = mint(server, session={"type": "realtime", "instructions": "x"}).json()["value"]
    with pytest.raises(InvalidStatus) as refused:
        with connect(server.ws(path), additional_headers={"Authorization": f"Bearer {key}"}):
            pass
    assert refused.value.response.status_code == 403
    assert b"/openai/v1/realtime" in refused.value.response.body


def test_a_key_minted_with_a_session_places_no_live_call(server):
    """Finding 9: a GPT-Live WebRTC session would start without the key's session: 403."""
    key = mint(server, session={"type": "realtime", "instructions": "x"}).json()["value"]
    response = httpx.post(server.http("/openai/v1/live/sessions"), timeout=30,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"session": {"model": "gpt-live"},
                                "transport": {"type": "webrtc", "sdp": "v=0"}})
    assert response.status_code in (403, 501), response.text
    if response.status_code == 403:
        assert "/openai/v1/realtime" in response.json()["error"]["message"]


# --- 10: no 500 from any input ---------------------------------------------------------------


def detached_token(server: LiveServer) -> str:
    """The resume token of a configured session whose link dropped (no close frame)."""
    client = RawClient(server.port, GA, headers=AUTH)
    created = event(client)
    client.send_json({"type": "session.update", "session": {"instructions": "Hi."}})
    while event(client)["type"] != "session.updated":
        pass
    abort(client)
    return created["session"]["resume_token"]


@pytest.mark.parametrize("last_seq", ["\u0663", "1" * 5000, "\uff11", "-0", "1e3", " 1"])
def test_a_resume_with_a_strange_last_seq_is_a_clear_refusal(server, last_seq):
    """Finding 10: non-ASCII digits or over 4,300 digits were a 500 with a traceback."""
    token = detached_token(server)
    url = server.ws(GA) + "?" + str(httpx.QueryParams({"resume_token": token,
                                                        "last_seq": last_seq}))
    with pytest.raises(InvalidStatus) as refused:
        with connect(url, additional_headers=AUTH):
            pass
    assert refused.value.response.status_code == 400, refused.value.response.body
    assert b"last_seq" in refused.value.response.body
    with connect(url.split("?")[0] + "?" + str(httpx.QueryParams(  # the session is there
            {"resume_token": token, "last_seq": "0"})), additional_headers=AUTH) as ws:
        assert recv(ws)["type"] == "session.resumed"


def test_a_wav_with_an_unknown_format_code_is_a_400(server):
    """Finding 10: it decoded to no samples and the transcription failed with a 500."""
    response = transcribe(server, wav(code=0x9999))
    assert response.status_code == 400, response.text
    assert "format code" in response.json()["error"]["message"]


def browser_offer() -> str:
    """An offer as a browser makes it (aiortc's): an audio and a data channel section."""
    from aiortc import RTCPeerConnection

    async def make() -> str:
        pc = RTCPeerConnection()
        pc.addTransceiver("audio", direction="sendrecv")
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        await pc.close()
        return pc.localDescription.sdp

    return asyncio.run(make())


@pytest.mark.parametrize("copies", [300, 3])
def test_an_sdp_offer_with_repeated_m_sections_is_a_400(server, copies):
    """Finding 10: hundreds of identical m-sections were a 500 with a traceback (aiortc
    takes the offer, then fails to answer it: so do three)."""
    pytest.importorskip("aiortc")
    head, *sections = re.split(r"(?=^m=)", browser_offer(), flags=re.M)
    offer = head + sections[0] * copies + "".join(sections[1:])
    response = httpx.post(server.http(GA + "/calls"), content=offer,
                          headers={**AUTH, "Content-Type": "application/sdp"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "sdp"


def test_a_message_past_the_values_bound_is_refused_before_it_is_parsed(monkeypatch):
    """Three attackers' 1 MiB messages of ``{}`` held the interpreter's lock a tenth of a
    second each while parsed, counted and freed: one past the bound by its commas alone
    (outside strings) is refused unparsed; commas inside strings do not count."""
    from types import SimpleNamespace

    from mlx_voicechat_plugin.server import wire

    parsed: list[int] = []
    monkeypatch.setattr(wire, "json", SimpleNamespace(
        loads=lambda text: parsed.append(len(text)) or json.loads(text)))
    flood = json.dumps({"type": "conversation.item.create", "item": {"content": [{}] * 340_000}})
    with pytest.raises(Exception, match="20000 JSON values"):
        wire.load_object(flood)
    assert parsed == []
    prose = json.dumps({"type": "session.update", "session": {"instructions": "a, " * 30_000}})
    assert wire.load_object(prose)["session"]["instructions"].startswith("a, ")
    assert parsed == [len(prose)]


def test_a_connection_is_read_no_faster_than_its_rate_past_the_burst():
    """A client sending megabyte messages back to back is read at the rate, not refused:
    past the burst, each frame waits until the budget has refilled."""
    from mlx_voicechat_plugin.server.transport.websocket import ReadRate, WebSocketTransport

    class Socket:
        async def receive(self):
            return {"type": "websocket.receive", "text": "x" * MIB}

    rate = 16 * MIB
    transport = WebSocketTransport(Socket(), 8, 1.0, max_pending_bytes=MIB,
                                   read_rate=ReadRate(rate, 2 * MIB))

    async def read(frames: int) -> float:
        started = time.monotonic()
        for _ in range(frames):
            assert len(await transport.receive()) == MIB
        return time.monotonic() - started

    assert asyncio.run(read(10)) >= (10 - 2) * MIB / rate * 0.95


def test_a_call_reads_its_data_channel_no_faster_than_its_rate_past_the_burst():
    """The WebRTC transport hands a call's data channel messages over at the same rate:
    messages sent back to back wait on the budget, and more than ``max_pending``
    waiting unread, or more than ``max_pending_bytes`` of them, end the call, so what a
    client can queue stays bounded."""
    pytest.importorskip("aiortc")
    from mlx_voicechat_plugin.server.messages import Hangup
    from mlx_voicechat_plugin.server.transport.webrtc import WebRTCTransport
    from mlx_voicechat_plugin.server.transport.websocket import ReadRate

    rate = 16 * MIB

    async def read(frames: int) -> tuple[float, object, list, list]:
        transport = WebRTCTransport(frames, 1.0, max_pending_bytes=frames * MIB,
                                    read_rate=ReadRate(rate, 2 * MIB))
        for _ in range(frames):
            transport._on_message("x" * MIB)
        started = time.monotonic()
        for _ in range(frames):
            assert len(await transport.receive()) == MIB
        elapsed = time.monotonic() - started
        for _ in range(frames + 1):  # one past max_pending unread: the call ends
            transport._on_message("y")
        by_count = transport.inbox[-1]
        transport = WebRTCTransport(frames, 1.0, max_pending_bytes=2 * MIB)
        for _ in range(3):  # the third megabyte is past max_pending_bytes: the call ends
            transport._on_message("x" * MIB)
        by_bytes = list(transport.inbox)
        transport = WebRTCTransport(frames, 1.0, max_pending_bytes=2 * MIB)
        for _ in range(3):  # text counts its UTF-8 bytes, not its characters
            transport._on_message("\u00e9" * (MIB // 2))
        return elapsed, by_count, by_bytes, list(transport.inbox)

    elapsed, by_count, by_bytes, by_utf8 = asyncio.run(read(10))
    assert elapsed >= (10 - 2) * MIB / rate * 0.95
    assert isinstance(by_count, Hangup)
    assert len(by_bytes) == 3 and isinstance(by_bytes[-1], Hangup)
    assert len(by_utf8) == 3 and isinstance(by_utf8[-1], Hangup)


def test_the_read_rate_is_a_serve_flag_with_its_default():
    from mlx_voicechat_plugin.cli.serve import build_parser

    assert ServerLimits().max_read_bytes_per_second == 2 * MIB
    args = build_parser().parse_args(["-m", "ckpt", "--max-read-bytes-per-second", "4096"])
    assert args.max_read_bytes_per_second == 4096
    with pytest.raises(ValueError, match="max_read_bytes_per_second"):
        ServerLimits(max_read_bytes_per_second=0)
