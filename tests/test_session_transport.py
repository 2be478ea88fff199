"""Each dialect driven with no socket, and a session that outlives its transport.

An in-memory transport (:mod:`mlx_voicechat_plugin.server.transport.memory`)
stands where the WebSocket was: the same connection, dialects and session
run over it on one event loop, with a real engine on the tiny checkpoint.
A session asked to outlive its transport is detached when the transport
ends (its slot held, its events kept) and goes on over a new one: the hook
that resuming after a drop will use.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from echo_dialect import ECHO

from mlx_voicechat_plugin.server.connection import Connection, connect
from mlx_voicechat_plugin.server.dialects import GA, VLM
from mlx_voicechat_plugin.server.dialects.base import BINARY_REFUSED
from mlx_voicechat_plugin.server.engine import Engine
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.messages import AudioOut, ClientNotReading, Ending, JsonOut
from mlx_voicechat_plugin.server.transport.memory import MemoryTransport

FRAME = 1280  # samples of one 80 ms frame at 16 kHz
MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    engine = Engine(str(tiny_ckpt), max_sessions=1)
    engine.start()
    assert engine.loaded.wait(120) and engine.ready
    yield engine
    engine.stop()


def pcm(samples: int, rate: int = 16_000) -> str:
    tone = 0.1 * np.sin(2 * np.pi * 220 * np.arange(samples) / rate)
    return base64.b64encode(np.round(tone * 32767).astype("<i2").tobytes()).decode()


def append(samples: int) -> dict:
    return {"type": "input_audio_buffer.append", "audio": pcm(samples), "sample_rate": 16_000}


async def until(transport: MemoryTransport, kind: str) -> list[dict]:
    events = []
    while (event := await transport.take())["type"] != kind:
        events.append(event)
    return events + [event]


async def closed(task: asyncio.Task, transport: MemoryTransport) -> Ending:
    await asyncio.wait_for(task, 10)
    return transport.closed[0]


def start(transport: MemoryTransport, dialect, engine: Engine,
          limits: ServerLimits | None = None) -> tuple[Connection, asyncio.Task]:
    connection = connect(transport, dialect, engine, MODEL, limits or ServerLimits())
    return connection, asyncio.ensure_future(connection.run())


def test_the_mlx_vlm_dialect_runs_over_memory(engine):
    async def scenario():
        transport = MemoryTransport()
        connection, task = start(transport, VLM, engine)
        assert (await transport.take())["type"] == "session.created"
        transport.put({"type": "session.update", "session": {"seed": 3}})
        assert (await transport.take())["type"] == "session.updated"
        transport.put(append(3 * FRAME + 100))
        transport.put({"type": "input_audio_buffer.commit"})
        events = await until(transport, "response.done")
        assert await closed(task, transport) is Ending.DONE
        assert connection.session.released and engine.admission.sessions_in_use == 0
        return transport, events

    transport, events = asyncio.run(scenario())
    audio = [m for m in transport.sent if isinstance(m, AudioOut)]
    assert audio and all(m.event["delta"] is None and m.encoding == "pcm16" for m in audio)
    deltas = [e for e in events if e["type"] == "response.audio.delta"]
    assert len(deltas) == len(audio)
    assert base64.b64decode(deltas[0]["delta"]) == audio[0].data
    assert "input_audio_buffer.committed" in [e["type"] for e in events]


def test_the_ga_dialect_runs_over_memory_and_its_owed_response_runs_on_silence(engine):
    async def scenario():
        transport = MemoryTransport()
        _, task = start(transport, GA, engine)
        assert (await transport.take())["type"] == "session.created"
        transport.put({"type": "session.update", "session": {
            "type": "realtime", "max_response_seconds": 0.4,
            "audio": {"input": {"turn_detection": None}}}})
        assert (await transport.take())["type"] == "session.updated"
        transport.put({"type": "input_audio_buffer.commit"})
        done = (await until(transport, "response.done"))[-1]
        transport.hang_up()
        await asyncio.wait_for(task, 10)
        assert engine.admission.sessions_in_use == 0
        return done

    done = asyncio.run(scenario())
    assert done["response"]["status"] in ("completed", "incomplete")


def test_a_third_dialect_runs_over_memory(engine):
    async def scenario():
        transport = MemoryTransport()
        _, task = start(transport, ECHO, engine)
        assert (await transport.take())["type"] == "hello"
        transport.put({"op": "start", "seed": 1})
        assert (await transport.take())["type"] == "ready"
        transport.put({"op": "audio", "pcm": pcm(2 * FRAME)})
        transport.put({"op": "stop"})
        ending = await closed(task, transport)
        return ending, transport.events()

    ending, events = asyncio.run(scenario())
    assert ending is Ending.DONE
    assert {e["type"] for e in events[2:]} == {"event"}


@pytest.mark.parametrize("dialect", [VLM, GA], ids=["mlx-vlm", "ga"])
def test_binary_frames_reach_the_dialect_which_refuses_them(engine, dialect):
    async def scenario():
        transport = MemoryTransport()
        _, task = start(transport, dialect, engine)
        await transport.take()
        transport.put(b"\x00\x01")
        error = await transport.take()
        transport.hang_up()
        await asyncio.wait_for(task, 10)
        return error

    error = asyncio.run(scenario())
    assert error["type"] == "error"
    assert error["error"]["code"] == "invalid_request"
    assert error["error"]["message"] == BINARY_REFUSED


def test_a_session_outlives_its_transport_when_asked_and_goes_on_over_a_new_one(engine):
    async def scenario():
        first = MemoryTransport()
        connection, task = start(first, VLM, engine)
        session = connection.session
        await first.take()
        first.put({"type": "session.update", "session": {"seed": 5}})
        assert (await first.take())["type"] == "session.updated"
        session.outlive_transports()
        first.put(append(4 * FRAME))
        await until(first, "response.audio.delta")
        first.hang_up()
        await asyncio.wait_for(task, 10)
        assert session.detached_or_claimed and not session.released
        assert engine.admission.sessions_in_use == 1  # the slot is still the session's
        await session.settle()  # the frames queued before the drop run meanwhile
        kept = session.replay.seq - session.replay.detached_after  # made while detached

        second = MemoryTransport()
        task = asyncio.ensure_future(Connection(second, session, resumed=True).run())
        assert (await second.take())["type"] == "session.resumed"
        resumed = [await second.take() for _ in range(kept)]
        second.put({"type": "session.ping"})
        assert (await second.take())["type"] == "session.pong"
        second.put(append(2 * FRAME))
        second.put({"type": "input_audio_buffer.commit"})
        rest = await until(second, "response.done")
        ending = await closed(task, second)
        assert session.released and engine.admission.sessions_in_use == 0
        return first.events(), resumed, rest, ending

    before, resumed, rest, ending = asyncio.run(scenario())
    assert ending is Ending.DONE
    assert not [e for e in before + resumed + rest if e["type"] == "session.created"][1:]
    first = [e["frame_index"] for e in before if "frame_index" in e]
    then = [e["frame_index"] for e in resumed + rest if "frame_index" in e]
    assert max(then) > max(first)  # one timeline, on over the new transport


def test_a_detached_session_is_released_when_its_deadline_passes(engine):
    async def scenario():
        transport = MemoryTransport()
        limits = ServerLimits(idle_timeout=0.3)
        connection, task = start(transport, VLM, engine, limits)
        session = connection.session
        session.outlive_transports()
        await transport.take()
        transport.put({"type": "session.update", "session": {}})
        await transport.take()
        transport.hang_up()
        await asyncio.wait_for(task, 10)
        assert session.detached_or_claimed and engine.admission.sessions_in_use == 1
        for _ in range(100):
            if session.released:
                break
            await asyncio.sleep(0.05)
        return session.released, engine.admission.sessions_in_use

    released, in_use = asyncio.run(scenario())
    assert released and in_use == 0


def test_unread_bytes_past_the_bound_mean_the_client_is_not_reading_a_replay_apart():
    """Like the WebSocket's outbox: new events count against ``max_pending_bytes`` until
    read (the last one may pass it), a resume's replay never does."""
    big = JsonOut({"type": "x", "pad": "x" * 1000})
    transport = MemoryTransport(max_pending_bytes=2500)
    transport.promise([big] * 10)  # promised: 10 KB, none of it unread
    for _ in range(3):
        transport.send(big)  # 0, ~1 KB, ~2 KB unread before each
    with pytest.raises(ClientNotReading, match="bytes of events"):
        transport.send(big)

    async def read_all() -> None:
        for _ in range(13):
            await transport.take()

    asyncio.run(read_all())
    transport.send(big)  # read: room again
