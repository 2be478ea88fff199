"""The official ``openai`` SDK's GA realtime client against our ``/openai/v1/realtime``.

Everything asserted is what the SDK parsed into its own event types.
"""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from ga_support import (
    API_KEY,
    MODEL,
    TOOL,
    base_url,
    call_frames,
    ga_server,
    question_wav_24k,
    scripted_call,
    silence_chunks,
    wav_chunks,
)
from tool_support import RESULT

openai = pytest.importorskip("openai")
from openai.types.realtime import (  # noqa: E402
    ConversationItemAdded,
    ConversationItemInputAudioTranscriptionDeltaEvent,
    InputAudioBufferCommittedEvent,
    RealtimeErrorEvent,
    ResponseAudioDeltaEvent,
    ResponseAudioTranscriptDeltaEvent,
    ResponseCreatedEvent,
    ResponseDoneEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseOutputItemAddedEvent,
    SessionCreatedEvent,
    SessionUpdatedEvent,
)

SESSION = {
    "type": "realtime",
    "instructions": "Be brief.",
    "output_modalities": ["audio"],
    "tools": [TOOL],
    "tool_choice": "auto",
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}},
              "output": {"format": {"type": "audio/pcm", "rate": 24000}}},
}


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from ga_server(tiny_ckpt)


def _client(server, api_key: str = API_KEY):
    return openai.AsyncOpenAI(api_key=api_key, base_url=base_url(server))


async def _until(connection, kind, events: list, timeout: float = 20.0, where=None):
    """Receive (keeping every event) until one of SDK type ``kind`` (and ``where``) arrives."""
    async def wait():
        while True:
            event = await connection.recv()
            events.append(event)
            if isinstance(event, kind) and (where is None or where(event)):
                return event
    return await asyncio.wait_for(wait(), timeout)


async def _send_audio(connection, chunks) -> None:
    for chunk in chunks:
        await connection.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())


async def _conversation(server, wav) -> dict:
    events: list = []
    async with _client(server).realtime.connect(model=MODEL) as connection:
        created = await _until(connection, SessionCreatedEvent, events)
        await connection.session.update(session=SESSION)
        updated = await _until(connection, SessionUpdatedEvent, events)

        sender = asyncio.ensure_future(_send_audio(connection, wav_chunks(wav)))
        call = await _until(connection, ResponseFunctionCallArgumentsDoneEvent, events)
        await sender
        await connection.conversation.item.create(item={
            "type": "function_call_output", "call_id": call.call_id, "output": RESULT})
        added = await _until(connection, ConversationItemAdded, events,
                             where=lambda e: e.item.type == "function_call_output")
        await _send_audio(connection, silence_chunks(1.0))
        await connection.input_audio_buffer.commit()
        committed = await _until(connection, InputAudioBufferCommittedEvent, events)
    return {"created": created, "updated": updated, "call": call, "added": added,
            "committed": committed, "events": events}


@pytest.fixture(scope="module")
def conversation(server, tmp_path_factory):
    import _pytest.monkeypatch

    patch = _pytest.monkeypatch.MonkeyPatch()
    try:
        script = scripted_call(server, patch)
        seconds = call_frames(script) * 0.08 + 0.5
        wav = question_wav_24k(tmp_path_factory.mktemp("ga") / "q24k.wav", seconds)
        server.wait_idle()
        return asyncio.run(_conversation(server, wav))
    finally:
        patch.undo()


def _of(conversation, kind):
    return [e for e in conversation["events"] if isinstance(e, kind)]


def test_session_objects_are_the_ga_ones(conversation):
    created, updated = conversation["created"].session, conversation["updated"].session
    assert created.type == "realtime" and created.model == MODEL
    assert created.audio.output.format.type == "audio/pcm"
    assert created.audio.output.format.rate == 24000
    assert updated.instructions == "Be brief."
    assert [tool.name for tool in updated.tools] == ["get_weather"]
    assert updated.output_modalities == ["audio"]


def test_a_response_opens_before_its_audio(conversation):
    kinds = [type(e) for e in conversation["events"]]
    first_audio = kinds.index(ResponseAudioDeltaEvent)
    assert kinds.index(ResponseCreatedEvent) < kinds.index(ResponseOutputItemAddedEvent) \
        < first_audio


def test_output_audio_is_24_khz_pcm16_under_one_item(conversation):
    deltas = _of(conversation, ResponseAudioDeltaEvent)
    assert deltas
    sizes = [len(base64.b64decode(d.delta)) for d in deltas]
    assert all(size % 2 == 0 for size in sizes)
    # one 80 ms codec frame at 22.05 kHz is 1764 samples: 1920 at 24 kHz
    assert abs(sum(sizes) / 2 / len(sizes) - 1920) < 200
    items = {d.item_id for d in deltas}
    added = {e.item.id for e in _of(conversation, ResponseOutputItemAddedEvent)}
    assert items <= added


def test_transcripts_arrive_for_both_sides(conversation):
    assert _of(conversation, ResponseAudioTranscriptDeltaEvent)
    assert _of(conversation, ConversationItemInputAudioTranscriptionDeltaEvent)


def test_the_tool_call_is_a_function_call_item(conversation):
    call = conversation["call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_")
    done = [e for e in _of(conversation, ResponseDoneEvent)
            if any(item.type == "function_call" for item in e.response.output)]
    assert len(done) == 1
    (item,) = [i for i in done[0].response.output if i.type == "function_call"]
    assert item.call_id == call.call_id and item.name == "get_weather"
    usage = done[0].response.usage
    assert usage.output_tokens == usage.output_token_details.text_tokens \
        + usage.output_token_details.audio_tokens


def test_the_tool_result_is_added_to_the_conversation(conversation):
    item = conversation["added"].item
    assert item.type == "function_call_output" and item.call_id == conversation["call"].call_id


def test_commit_is_acknowledged_and_nothing_failed(conversation):
    assert conversation["committed"].item_id
    assert not _of(conversation, RealtimeErrorEvent)


def test_the_sdks_default_model_is_served_as_the_served_id(server):
    """Any ``model`` opens a session on the served model (``--strict-model`` refuses
    other names: test_server_ga_model_names.py)."""
    async def attempt():
        async with _client(server).realtime.connect(model="gpt-realtime") as connection:
            return await connection.recv()

    created = asyncio.run(attempt())
    assert isinstance(created, SessionCreatedEvent) and created.session.model == MODEL


def test_a_wrong_api_key_is_refused(server):
    async def attempt():
        async with _client(server, "wrong").realtime.connect(model=MODEL) as connection:
            await connection.recv()

    with pytest.raises(Exception) as failure:
        asyncio.run(attempt())
    assert "401" in str(failure.value)


def test_the_example_client_runs_the_tool_and_writes_the_answer(server, monkeypatch, tmp_path,
                                                                 capsys):
    import importlib.util
    import wave
    from pathlib import Path

    script = scripted_call(server, monkeypatch)
    path = Path(__file__).resolve().parent.parent / "examples" / "openai_sdk_client.py"
    spec = importlib.util.spec_from_file_location("openai_sdk_client", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    wav = question_wav_24k(tmp_path / "q.wav", call_frames(script) * 0.08)
    server.wait_idle()
    answer = tmp_path / "a.wav"
    assert example.main([base_url(server), str(wav), str(answer), "--api-key", API_KEY,
                         "--model", MODEL, "--extra-seconds", "1.5"]) == 0
    out = capsys.readouterr().out
    assert '[tool] get_weather({"city": "Paris"}) -> {"condition": "sunny"' in out
    with wave.open(str(answer)) as written:
        assert written.getframerate() == 24000 and written.getnframes() > 0


def test_a_text_only_session_streams_only_the_user_transcript(server, tmp_path):
    """``output_modalities: ["text"]``: perception and RNNT only, as in the mlx-vlm dialect."""
    from openai.types.realtime import (
        ConversationItemInputAudioTranscriptionCompletedEvent as Completed,
    )

    wav = question_wav_24k(tmp_path / "q24k.wav", 1.5)
    session = {"type": "realtime", "output_modalities": ["text"],
               "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}}

    async def run() -> list:
        events: list = []
        async with _client(server).realtime.connect(model=MODEL) as connection:
            await _until(connection, SessionCreatedEvent, events)
            await connection.session.update(session=session)
            await _until(connection, SessionUpdatedEvent, events)
            await _send_audio(connection, wav_chunks(wav))
            await _send_audio(connection, silence_chunks(0.5))
            await connection.input_audio_buffer.commit()
            await _until(connection, Completed, events)
        return events

    server.wait_idle()
    events = asyncio.run(run())
    deltas = [e for e in events if isinstance(e, ConversationItemInputAudioTranscriptionDeltaEvent)]
    assert deltas
    (completed,) = [e for e in events if isinstance(e, Completed)]
    assert completed.transcript == "".join(d.delta for d in deltas)
    assert not [e for e in events if isinstance(e, (ResponseAudioDeltaEvent, ResponseCreatedEvent,
                                                     RealtimeErrorEvent))]
