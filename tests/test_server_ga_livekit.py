"""LiveKit Agents' OpenAI realtime plugin against our GA route, without a LiveKit room.

The plugin's :class:`RealtimeSession` is the object an ``AgentSession`` drives:
here the test drives it directly (instructions, tools, audio frames, a tool
output through ``update_chat_ctx``) and reads its generations: message
streams of ``rtc.AudioFrame`` and text, and function calls.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from ga_support import (
    API_KEY,
    GA_RATE,
    MODEL,
    base_url,
    call_frames,
    ga_server,
    question_wav_24k,
    scripted_call,
    silence_chunks,
    wav_chunks,
)
from tool_support import RESULT

pytest.importorskip("livekit.agents")
lk_openai = pytest.importorskip("livekit.plugins.openai")
from livekit import rtc  # noqa: E402
from livekit.agents import llm  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from ga_server(tiny_ckpt)


@llm.function_tool
async def get_weather(city: str) -> str:
    """Current weather for a city."""
    return RESULT


def _frame(chunk: bytes) -> rtc.AudioFrame:
    return rtc.AudioFrame(data=chunk, sample_rate=GA_RATE, num_channels=1,
                          samples_per_channel=len(chunk) // 2)


async def _drain(generation, found: dict) -> None:
    """Read one generation as an AgentSession would: its messages, then its calls."""
    async def message(stream):
        text = ""
        async for piece in stream.text_stream:
            text += str(piece)
        found["texts"].append(text)

    async def audio(stream):
        async for frame in stream.audio_stream:
            found["audio"].append(frame)

    tasks = []
    async for stream in generation.message_stream:
        tasks += [asyncio.ensure_future(message(stream)), asyncio.ensure_future(audio(stream))]
    async for call in generation.function_stream:
        found["calls"].append(call)
    await asyncio.gather(*tasks)


async def _run(server, wav, found: dict) -> None:
    model = lk_openai.realtime.RealtimeModel(model=MODEL, base_url=base_url(server),
                                             api_key=API_KEY)
    session = model.session()
    drains = []
    session.on("generation_created",
               lambda generation: drains.append(asyncio.ensure_future(_drain(generation, found))))
    session.on("error", lambda error: found["errors"].append(error))
    session.on("input_audio_transcription_completed",
               lambda event: found["transcripts"].append(event))
    try:
        await session.update_instructions("Be brief.")
        await session.update_tools([get_weather])
        for chunk in wav_chunks(wav):
            session.push_audio(_frame(chunk))
        for _ in range(300):
            if found["calls"]:
                break
            await asyncio.sleep(0.05)
        assert found["calls"], "no function call reached the plugin"
        call = found["calls"][0]
        context = session.chat_ctx.copy()
        context.items.append(llm.FunctionCallOutput(call_id=call.call_id, name=call.name,
                                                    output=RESULT, is_error=False))
        await session.update_chat_ctx(context)  # waits for the server's item.added
        found["answered"] = any(item.type == "function_call_output"
                                for item in session.chat_ctx.items)
        found["items"] = [item.type for item in session.chat_ctx.items]
        for chunk in silence_chunks(1.0):
            session.push_audio(_frame(chunk))
        await asyncio.sleep(1.0)
        # generate_reply() resolves at the response.created that carries its
        # event id (LiveKit gives up after 10 s); each generation's streams end
        # at its response.done.
        reply = await session.generate_reply()
        found["reply"] = reply.user_initiated
        await asyncio.wait_for(asyncio.gather(*drains), 30)
        found["generations"] = len(drains)
    finally:
        await session.aclose()
        await model.aclose()
        for task in drains:
            task.cancel()


@pytest.fixture(scope="module")
def session(server, tmp_path_factory):
    import _pytest.monkeypatch

    patch = _pytest.monkeypatch.MonkeyPatch()
    try:
        script = scripted_call(server, patch)
        wav = question_wav_24k(tmp_path_factory.mktemp("livekit") / "q24k.wav",
                               call_frames(script) * 0.08 + 0.5)
        server.wait_idle()
        found = {"texts": [], "audio": [], "calls": [], "errors": [], "transcripts": [], "items": []}
        asyncio.run(_run(server, wav, found))
        return found
    finally:
        patch.undo()


def test_a_generation_carries_24_khz_audio_frames(session):
    frames = session["audio"]
    assert frames and all(f.sample_rate == 24000 and f.num_channels == 1 for f in frames)
    assert sum(f.samples_per_channel for f in frames) > 24000 * 0.5


def test_the_generation_has_its_transcript(session):
    assert any(text for text in session["texts"])


def test_the_function_call_reaches_the_plugin(session):
    (call,) = session["calls"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_the_tool_output_is_confirmed_by_the_server(session):
    assert session["answered"], session["items"]


def test_user_transcripts_reach_the_plugin(session):
    assert session["transcripts"]


def test_the_plugin_reported_no_error(session):
    assert session["errors"] == []


def test_generate_reply_gets_its_response_and_every_generation_ends(session):
    assert session["reply"] is True  # the response created for generate_reply()
    assert session["generations"] >= 2  # the tool call's, the reply's; each one done
