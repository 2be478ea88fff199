"""An operator's streamable-HTTP MCP server seen by each dialect's client: GA (strictly
validated, and the openai SDK), NVIDIA's; its secret header reaches the MCP server only."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

import pytest
from ga_support import (API_KEY, MODEL, base_url, call_frames, question_wav_24k, scripted_call,
                        silence_chunks, wav_chunks)
from mcp_support import SECRET, calls, ga_until, mcp_log, mcp_server  # noqa: F401 (fixtures)
from server_support import LiveServer, connect, recv, running, send

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.mcp.config import parse_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GA_PATH = f"/openai/v1/realtime?model={MODEL}"
SESSION = {"type": "realtime", "instructions": "Be brief.", "output_modalities": ["audio"],
           "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}},
                     "output": {"format": {"type": "audio/pcm", "rate": 24000}}}}


@pytest.fixture(scope="module")
def server(tiny_ckpt, mcp_server):
    spec = parse_server("web", {"url": mcp_server.url,
                                "headers": {"Authorization": f"Bearer {SECRET}"}})
    limits = ServerLimits(update_timeout=20, idle_timeout=30)
    app = create_app(tiny_ckpt, api_key=API_KEY, limits=limits, mcp_servers=[spec])
    live = LiveServer(app)
    deadline = time.monotonic() + 60
    while not app.state.mcp.connections["web"].connected:
        assert time.monotonic() < deadline, app.state.mcp.connections["web"].error
        time.sleep(0.05)
    yield from running(live)


_until = ga_until


def _audio(chunk: bytes) -> dict:
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}


def test_ga_client_sees_an_mcp_call_item_every_event_valid(server, mcp_server, mcp_log,
                                                           monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    script = scripted_call(server, monkeypatch)
    wav = question_wav_24k(tmp_path / "q.wav", call_frames(script) * 0.08 + 0.5)
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as ws:
        _until(ws, "session.created", events)
        send(ws, {"type": "session.update", "session": SESSION})
        _until(ws, "session.updated", events)
        for chunk in wav_chunks(wav):
            send(ws, _audio(chunk))
        done = _until(ws, "response.mcp_call_arguments.done", events)
        assert json.loads(done["arguments"]) == {"city": "Paris"}
        completed = _until(ws, "response.mcp_call.completed", events)
        item = _until(ws, "conversation.item.done", events)["item"]
        assert item["type"] == "mcp_call" and item["id"] == completed["item_id"]
        assert (item["server_label"], item["name"]) == ("web", "get_weather")
        assert json.loads(item["output"]) == {"city": "Paris", "temp": 21}
        for chunk in silence_chunks(0.5):
            send(ws, _audio(chunk))
        send(ws, {"type": "input_audio_buffer.commit"})
        _until(ws, "input_audio_buffer.committed", events)
    assert not [e for e in events if e["type"] == "error"]
    assert calls(mcp_log)[-1]["arguments"] == {"city": "Paris"}
    # The secret header reached the MCP server, and nothing else: no event, no log line.
    assert any(h.get("authorization") == f"Bearer {SECRET}" for h in mcp_server.headers)
    assert SECRET not in json.dumps(events) and SECRET not in caplog.text


def test_the_openai_sdk_runs_an_mcp_session_with_no_error_event(server, monkeypatch, tmp_path):
    import openai
    from openai.types.realtime import (RealtimeErrorEvent, ResponseMcpCallCompleted,
                                       SessionUpdatedEvent)

    script = scripted_call(server, monkeypatch)
    wav = question_wav_24k(tmp_path / "q.wav", call_frames(script) * 0.08 + 0.5)
    server.wait_idle()

    async def run() -> list:
        events: list = []
        client = openai.AsyncOpenAI(api_key=API_KEY, base_url=base_url(server))
        async with client.realtime.connect(model=MODEL) as connection:
            await connection.session.update(session=SESSION)

            async def until(kind):
                while True:
                    event = await connection.recv()
                    events.append(event)
                    if isinstance(event, kind):
                        return event

            await asyncio.wait_for(until(SessionUpdatedEvent), 30)
            for chunk in wav_chunks(wav):
                await connection.input_audio_buffer.append(
                    audio=base64.b64encode(chunk).decode())
            await asyncio.wait_for(until(ResponseMcpCallCompleted), 60)
        return events

    events = asyncio.run(run())
    assert not [e for e in events if isinstance(e, RealtimeErrorEvent)]


def test_nvidia_client_sees_the_call_and_its_result(server, monkeypatch):
    script = scripted_call(server, monkeypatch)
    server.wait_idle()
    rate = 24_000
    import numpy as np
    import soxr

    from mlx_voicechat_plugin.testing.fixtures import question_signal

    samples = soxr.resample(question_signal(call_frames(script) * 0.08 + 0.5), 16_000, rate)
    data = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    step = rate * 80 // 1000 * 2
    with connect(server.ws("/nvidia/v1/realtime"), additional_headers=AUTH) as ws:
        assert recv(ws)["type"] == "session.created"
        send(ws, {"type": "session.update", "session": {
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": rate}},
                      "output": {"format": "pcm16"}}}})
        assert recv(ws)["type"] == "session.updated"
        for i in range(0, len(data), step):
            send(ws, _audio(data[i:i + step]))
        seen: list[dict] = []
        while not any(e["type"] == "conversation.item.function_call_output" for e in seen):
            seen.append(recv(ws, 30))
    (call,) = [e for e in seen if e["type"] == "response.function_call_arguments.done"]
    (output,) = [e for e in seen if e["type"] == "conversation.item.function_call_output"]
    assert call["name"] == "get_weather" and output["call_id"] == call["call_id"]
    assert json.loads(output["output"])["temp"] == 21
    assert not [e for e in seen if e["type"] == "error"]


def test_the_agents_sdk_runs_an_mcp_session_with_no_error(server, monkeypatch, tmp_path):
    agents = pytest.importorskip("agents.realtime")

    script = scripted_call(server, monkeypatch)
    wav = question_wav_24k(tmp_path / "q.wav", call_frames(script) * 0.08 + 0.5)
    server.wait_idle()

    def raw(events, kind):
        return [e for e in events if e.type == "raw_model_event"
                and e.data.type == "raw_server_event" and e.data.data.get("type") == kind]

    async def run() -> list:
        agent = agents.RealtimeAgent(name="Assistant", instructions="Be brief.")
        runner = agents.RealtimeRunner(agent)
        session = await runner.run(model_config={
            "url": server.ws("/openai/v1/realtime?model=gpt-realtime"), "api_key": API_KEY})
        events: list = []
        async with session:
            async def read() -> None:
                async for event in session:
                    events.append(event)
                    if any(e.data.data["item"]["type"] == "mcp_call"
                           for e in raw(events, "conversation.item.done")):
                        return

            reader = asyncio.ensure_future(read())
            while not raw(events, "session.updated"):
                await asyncio.sleep(0.05)
            for chunk in wav_chunks(wav) + silence_chunks(0.5):
                await session.send_audio(chunk)
            await asyncio.wait_for(reader, 60)
        return events

    events = asyncio.run(run())
    (item,) = [e.data.data["item"] for e in raw(events, "conversation.item.done")
               if e.data.data["item"]["type"] == "mcp_call"] or [None]
    assert item is not None and json.loads(item["output"])["temp"] == 21
    assert not [e for e in events if e.type == "error"]


def test_a_cancelled_response_cancels_its_call_and_the_model_hears_so(server, monkeypatch,
                                                                      tmp_path, mcp_log):
    text = '<TOOLCALL>[{"name": "slow", "arguments": {"seconds": 25}}]</TOOLCALL>'
    script = scripted_call(server, monkeypatch, text)
    wav = question_wav_24k(tmp_path / "q.wav", call_frames(script) * 0.08 + 0.5)
    server.wait_idle()
    events: list[dict] = []
    with connect(server.ws(GA_PATH), additional_headers=AUTH) as ws:
        _until(ws, "session.created", events)
        send(ws, {"type": "session.update", "session": SESSION})
        _until(ws, "session.updated", events)
        for chunk in wav_chunks(wav):
            send(ws, _audio(chunk))
        _until(ws, "response.mcp_call.in_progress", events)
        while not calls(mcp_log) or calls(mcp_log)[-1]["name"] != "slow":
            time.sleep(0.05)  # the MCP server has the call
        send(ws, {"type": "response.cancel"})  # the user barges in
        failed = _until(ws, "response.mcp_call.failed", events)
        item = _until(ws, "conversation.item.done", events)["item"]
        assert item["id"] == failed["item_id"]
        assert item["error"]["message"].startswith("cancelled: ")
