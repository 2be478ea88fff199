"""A hostile-client sweep through real sockets (issue 51): clients in every dialect send
mutated and malformed messages, binary frames, deep nesting and near-limit sizes,
interleaved at random (seeded, bounded), and leave as they please (a close frame, a
reset, mid anything). Afterwards the server's log holds no traceback and no error,
no client met a 1011 close, no session is left holding a slot, and a clean session
still answers."""

from __future__ import annotations

import base64
import gc
import json
import logging
import random
import socket
import struct
import threading

import numpy as np
import pytest
from raw_client import RawClient
from resume_support import abort
from server_support import FRAME, LiveServer, append_message, connect, configure, recv, running

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits

SEED = 51
CLIENTS = 4  # at once
CONNECTIONS = 60  # in all, over the three dialects
MESSAGES = 12  # at most, per connection
LIMIT = 64 * 1024  # --max-message-bytes
CLOSE, INTERNAL_ERROR = 0x8, 1011

PATHS = ["/v1/realtime", "/openai/v1/realtime", "/nvidia/v1/realtime"]
PCM = np.zeros(2 * FRAME, "<i2").tobytes()
VALID = [
    {"type": "session.update", "session": {}},
    {"type": "session.update", "session": {"type": "realtime"}},
    {"type": "session.update", "session": {"instructions": "Be brief.", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}]}},
    append_message(np.zeros(2 * FRAME, np.float32)),
    {"type": "input_audio_buffer.append", "audio": base64.b64encode(PCM).decode()},
    {"type": "input_audio_buffer.commit"}, {"type": "input_audio_buffer.clear"},
    {"type": "response.create"}, {"type": "response.cancel"}, {"type": "session.cancel"},
    {"type": "session.ping"}, {"type": "session.end"},
    {"type": "conversation.item.create", "item": {"type": "function_call_output",
                                                   "call_id": "c", "output": "{}"}},
]
ODD = [None, True, -1, 2**70, 1e308, float("nan"), "", "\udcff" * 3, [], {}, [[[]]],
       {"type": None}, "x" * 1000]


def mutated(rng: random.Random, message: dict) -> dict:
    """``message`` with a field dropped, replaced by an odd value, or added."""
    message = json.loads(json.dumps(message))
    target = message
    while rng.random() < 0.5:
        nested = [v for v in target.values() if isinstance(v, dict)]
        if not nested:
            break
        target = rng.choice(nested)
    key = rng.choice(list(target) or ["type"])
    choice = rng.random()
    if choice < 0.3:
        target.pop(key, None)
    elif choice < 0.8:
        target[key] = rng.choice(ODD)
    else:
        target["x" * rng.randint(1, 40)] = rng.choice(ODD)
    return message


def hostile(rng: random.Random) -> tuple[int, bytes]:
    """One client frame: ``(opcode, payload)``."""
    kind = rng.choice(["valid", "mutated", "mutated", "malformed", "binary", "nested",
                       "near_limit", "over_limit", "unicode"])
    if kind == "valid":
        message = rng.choice(VALID)
    elif kind == "mutated":
        message = mutated(rng, rng.choice(VALID))
    elif kind == "malformed":
        text = json.dumps(rng.choice(VALID))
        return 0x1, rng.choice([text[:rng.randint(0, len(text))], "{" * 50, "null", "[]",
                                '{"type": "session.update", "session": }', "\x00\x01"]).encode()
    elif kind == "binary":
        return 0x2, rng.choice([PCM, PCM[:rng.randint(0, 99)], rng.randbytes(rng.randint(0, 3000))])
    elif kind == "nested":
        depth = rng.choice([64, 1000, 20_000])
        return 0x1, ('{"type": "session.update", "session": ' + "[" * depth + "]" * depth
                     + "}").encode()
    elif kind in ("near_limit", "over_limit"):
        size = LIMIT - 200 if kind == "near_limit" else LIMIT + rng.randint(1, 1000)
        return 0x1, json.dumps({"type": "session.update", "session": {
            "instructions": "x" * size}})[:size].encode()
    else:
        return 0x1, json.dumps({"type": rng.choice(["session.update", "\u0000", "é" * 40]),
                                "session": {"instructions": "\ud800 \U0001f600"}}
                               ).encode("utf-8", "surrogatepass")
    return 0x1, json.dumps(message).encode()


def ours(record: logging.LogRecord) -> bool:
    """A record of the server's (its loggers, or asyncio's about its tasks and futures)."""
    return not record.name.startswith(("asyncio", "httpx")) or \
        "mlx_voicechat_plugin" in record.getMessage() or "Prefill" in record.getMessage()


def closes(client: RawClient, seconds: float) -> list[int]:
    """The close codes read within ``seconds`` (events are read and dropped)."""
    client.sock.settimeout(seconds)
    codes = []
    try:
        while True:
            opcode, payload = client.read_frame()
            if opcode == CLOSE:
                codes.append(struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005)
                return codes
    except (OSError, EOFError):
        return codes


def one_client(port: int, seed: int, codes: list[int]) -> None:
    rng = random.Random(seed)
    try:
        client = RawClient(port, rng.choice(PATHS))
    except (AssertionError, OSError):
        return
    try:
        for _ in range(rng.randint(1, MESSAGES)):
            opcode, payload = hostile(rng)
            client.send_frame(payload, opcode)
            got = closes(client, rng.choice([0.0, 0.01, 0.05]))
            if got:
                codes.extend(got)
                return
        ending = rng.choice(["close", "reset", "leave", "update_and_reset"])
        if ending == "update_and_reset":  # gone while its prompt prefills
            client.send_json(rng.choice(VALID[:3]))
        if ending.endswith("reset"):
            abort(client)
            return
        if ending == "close":
            client.send_frame(struct.pack("!H", 1000), opcode=CLOSE)
        codes.extend(closes(client, 0.2))
    except OSError:  # the server closed first (a size cap, a violation)
        pass
    finally:
        try:
            client.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        client.close()


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=3, idle_timeout=3, max_sessions=CLIENTS,
                          resume_seconds=1, max_message_bytes=LIMIT)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits, api_key_env=None)))


def test_a_hostile_sweep_leaves_no_traceback_no_1011_no_session_and_a_working_server(
        server, caplog):
    gc.collect()  # earlier tests' garbage is not this server's
    caplog.set_level(logging.INFO)
    codes: list[int] = []
    seeds = random.Random(SEED)
    for _ in range(CONNECTIONS // CLIENTS):
        threads = [threading.Thread(target=one_client, args=(server.port, seeds.random(), codes),
                                    daemon=True) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    server.wait_idle()
    health = server.health().json()
    assert health["sessions"] == 0 and health["detached"] == 0
    assert INTERNAL_ERROR not in codes, codes
    with connect(server.ws()) as ws:  # a clean session still answers
        configure(ws)
        ws.send(json.dumps(append_message(np.zeros(2 * FRAME, np.float32))))
        while (event := recv(ws))["type"] != "response.audio.delta":
            assert event["type"] != "error", event
    server.wait_idle()
    gc.collect()  # a future whose exception nobody took is logged when collected
    bad = [r for r in caplog.records if ours(r) and (
        r.levelno >= logging.ERROR or r.exc_info or "Traceback" in r.getMessage())]
    assert bad == [], [f"{r.name}: {r.getMessage()}" for r in bad]
