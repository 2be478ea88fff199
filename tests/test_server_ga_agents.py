"""The OpenAI Agents SDK's ``RealtimeRunner`` against our GA route, through real sockets.

A ``RealtimeAgent`` with a function tool, over the SDK's GA WebSocket model, set up as
its docs show, pointed at the server with the SDK's default model name
(``gpt-realtime``). The SDK validates every server event against the openai package's
types and reports each that fails as an error; it runs the tool the fixture scripts
and sends its output back, which the model is given (the function channel is forced
with it). No error reaches the session but those OpenAI's own server sends (a
``response.cancel`` with no response running: the SDK cancels at a barge-in when the
session's turn detection does not interrupt by itself).
"""

from __future__ import annotations

import asyncio

import pytest
from ga_support import API_KEY, MODEL, ga_server, scripted_question, silence_chunks, wav_chunks

pytest.importorskip("agents.realtime")
from agents import function_tool  # noqa: E402
from agents.realtime import RealtimeAgent, RealtimeRunner  # noqa: E402

# What OpenAI's server says too, should the SDK cancel with no response running.
OPENAIS_OWN_ERRORS = {"response_cancel_not_active"}
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from ga_server(tiny_ckpt)


@function_tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return '{"temp": 21}'


def _raw(events: list, kind: str) -> list[dict]:
    """The server events of ``kind`` the SDK read (its raw model events)."""
    return [e.data.data for e in events if e.type == "raw_model_event"
            and e.data.type == "raw_server_event" and e.data.data.get("type") == kind]


def _kinds(events: list) -> list[str]:
    return [e.data.data.get("type") if e.type == "raw_model_event"
            and e.data.type == "raw_server_event" else e.type for e in events]


def _given(script) -> bool:
    """The tool's output has been forced into the function channel, to its end."""
    forced = script.forced
    first = next((i for i, t in enumerate(forced) if t is not None), None)
    return first is not None and None in forced[first:]


# The SDK's defaults (24 kHz PCM16 both ways, semantic VAD that interrupts by itself),
# and server VAD without interrupt_response: the SDK then cancels at each barge-in.
SETTINGS = {"defaults": None,
            "sdk cancels": {"turn_detection": {"type": "server_vad",
                                               "interrupt_response": False}}}


async def _converse(server, wav, script, settings: dict | None) -> list:
    agent = RealtimeAgent(name="Assistant", instructions="Be brief.", tools=[get_weather])
    runner = RealtimeRunner(agent, config=None if settings is None
                            else {"model_settings": settings})
    url = server.ws("/openai/v1/realtime?model=gpt-realtime")
    events: list = []
    arrived = asyncio.Event()

    async def until(done) -> None:
        while not done():
            arrived.clear()
            try:
                await asyncio.wait_for(arrived.wait(), TIMEOUT)
            except asyncio.TimeoutError:
                raise AssertionError(f"timed out; read {_kinds(events)[-30:]}") from None

    session = await runner.run(model_config={"url": url, "api_key": API_KEY})
    async with session:
        async def read() -> None:
            async for event in session:
                events.append(event)
                arrived.set()

        reader = asyncio.ensure_future(read())
        try:
            # The tools are set before audio flows, as a transport's first audio comes
            # after the session is up (a later tool change restarts the timeline).
            await until(lambda: any(e["session"]["tools"]
                                    for e in _raw(events, "session.updated")))
            for chunk in wav_chunks(wav) + silence_chunks(0.5):
                await session.send_audio(chunk)
            await until(lambda: any(e.type == "tool_end" for e in events))
            # the response the SDK asks for with the tool's output ends
            ended = len(_raw(events, "response.done"))
            for _ in range(int(TIMEOUT / 0.1)):  # the model hears on while it is given it
                if _given(script):
                    break
                await session.send_audio(silence_chunks(0.1)[0])
                await asyncio.sleep(0.05)
            await until(lambda: len(_raw(events, "response.done")) > ended)
            await asyncio.sleep(0.5)  # the SDK's last events (a retrieve's answer)
        finally:
            reader.cancel()
    return events


@pytest.fixture(scope="module", params=list(SETTINGS))
def conversation(server, tmp_path_factory, request):
    with scripted_question(server, tmp_path_factory, "agents") as (script, wav):
        events = asyncio.run(_converse(server, wav, script, SETTINGS[request.param]))
    tokenizer = server.app.state.engine.voicechat.tokenizer
    return {"events": events,
            "forced": tokenizer.decode([t for t in script.forced if t is not None])}


def test_the_session_is_the_served_model_with_the_agents_tool(conversation):
    (created,) = _raw(conversation["events"], "session.created")
    assert created["session"]["model"] == MODEL  # asked for gpt-realtime
    updated = _raw(conversation["events"], "session.updated")
    assert [t["name"] for t in updated[-1]["session"]["tools"]] == ["get_weather"]


def test_audio_and_transcripts_come_out(conversation):
    events = conversation["events"]
    assert sum(len(e.audio.data) for e in events if e.type == "audio") > 0
    assert _raw(events, "response.output_audio_transcript.delta")
    assert _raw(events, "conversation.item.input_audio_transcription.delta")


def test_a_turn_completes(conversation):
    events = conversation["events"]
    assert any(e.type == "agent_end" for e in events)
    statuses = [e["response"]["status"] for e in _raw(events, "response.done")]
    assert "completed" in statuses


def test_the_sdk_runs_the_scripted_tool_and_its_output_reaches_the_model(conversation):
    events = conversation["events"]
    (start,) = [e for e in events if e.type == "tool_start"]
    (end,) = [e for e in events if e.type == "tool_end"]
    assert start.tool.name == "get_weather" and '"Paris"' in end.arguments
    assert end.output == '{"temp": 21}'
    outputs = [e["item"] for e in _raw(events, "conversation.item.added")
               if e["item"]["type"] == "function_call_output"]
    assert [o["output"] for o in outputs] == ['{"temp": 21}']
    forced = conversation["forced"]  # the function channel was given the result
    assert "TOOL_RESPONSE" in forced and "21" in forced


def test_no_error_but_openais_own(conversation):
    errors = [e.error for e in conversation["events"] if e.type == "error"]
    codes = [getattr(error, "code", None) for error in errors]
    assert set(codes) <= OPENAIS_OWN_ERRORS, errors  # a schema failure has no code


def test_the_sdks_retrieve_is_answered(conversation):
    events = conversation["events"]
    assert _raw(events, "conversation.item.retrieved")
    assert not [e for e in _raw(events, "error")
                if "unsupported" in e["error"]["message"]]
