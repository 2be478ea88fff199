"""Turn semantics with the official ``openai`` SDK: every response ends, push-to-talk answers.

A push-to-talk client (turn detection off) appends its question, commits and
waits for ``response.done``; a server-VAD client streams on with pauses. Every
``response.created`` must be followed by its ``response.done`` with usage, and
each response's ``.done`` events must close what its ``.added`` events opened.
One ``OpenAI(base_url=".../openai/v1")`` also lists models and transcribes.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
from collections import defaultdict

import pytest
from ga_support import API_KEY, GA_RATE, MODEL, base_url, ga_server, question_wav_24k

openai = pytest.importorskip("openai")

CHUNK_MS = 40
BOUND_SECONDS = 2.0  # session.max_response_seconds in these tests
BOUND_FRAMES = math.ceil(BOUND_SECONDS / 0.08)
TURN_TIMEOUT = 60.0  # generous wall-clock cap on a shared 2-core machine, not a claim


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from ga_server(tiny_ckpt)


def _session(turn_detection) -> dict:
    return {"type": "realtime", "output_modalities": ["audio"],
            "max_response_seconds": BOUND_SECONDS,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": GA_RATE},
                                "turn_detection": turn_detection},
                      "output": {"format": {"type": "audio/pcm", "rate": GA_RATE}}}}


def _chunks(pcm: bytes) -> list[str]:
    step = GA_RATE * CHUNK_MS // 1000 * 2
    return [base64.b64encode(pcm[i : i + step]).decode() for i in range(0, len(pcm), step)]


def _speech(path, seconds: float) -> bytes:
    import wave

    with wave.open(str(question_wav_24k(path, seconds)), "rb") as wav:
        return wav.readframes(wav.getnframes())


def _silence(seconds: float) -> bytes:
    return bytes(round(seconds * GA_RATE) * 2)


async def _until_settled(connection, events: list) -> None:
    """Receive (keeping every event) until a ``response.done`` has come after the
    commit and every response created so far is done (the model may also speak
    over the question)."""
    def open_ids() -> set[str]:
        sdk = _sdk_events(events)
        return {e.response.id for e in sdk if e.type == "response.created"} \
            - {e.response.id for e in sdk if e.type == "response.done"}

    async def wait():
        committed = done = False  # the commit is handled after the audio before it
        while not done or open_ids():
            event = await connection.recv()
            events.append(event)
            committed = committed or event.type == "input_audio_buffer.committed"
            done = done or (committed and event.type == "response.done")
    await asyncio.wait_for(wait(), TURN_TIMEOUT)


async def _push_to_talk(server, tmp_path) -> list:
    """Two push-to-talk turns: 3.1 s of speech + 1 s of silence, commit, response.done."""
    question = _speech(tmp_path / "q.wav", 3.1) + _silence(1.0)
    events: list = []
    client = openai.AsyncOpenAI(api_key=API_KEY, base_url=base_url(server))
    async with client.realtime.connect(model=MODEL) as connection:
        await connection.session.update(session=_session(None))
        for turn in range(2):
            for chunk in _chunks(question):
                await connection.input_audio_buffer.append(audio=chunk)
            await connection.input_audio_buffer.commit()
            events.append(("turn", turn))
            await _until_settled(connection, events)
        events.append(("open", connection))  # the session is still usable after both
        await connection.session.update(session={"type": "realtime"})
        while (event := await asyncio.wait_for(connection.recv(), TURN_TIMEOUT)).type \
                != "session.updated":
            events.append(event)
        events.append(event)
    return events


@pytest.fixture(scope="module")
def push_to_talk(server, tmp_path_factory):
    server.wait_idle()
    return asyncio.run(_push_to_talk(server, tmp_path_factory.mktemp("ptt")))


def _sdk_events(events) -> list:
    return [e for e in events if not isinstance(e, tuple)]


def _turns(events) -> list[list]:
    """The events after each turn's commit, up to the next turn."""
    turns: list[list] = []
    for event in events:
        if isinstance(event, tuple):
            if event[0] == "turn":
                turns.append([])
        elif turns:
            turns[-1].append(event)
    return turns


def test_push_to_talk_each_turn_ends_with_response_done_and_usage(push_to_talk):
    turns = _turns(push_to_talk)
    assert len(turns) == 2
    for turn in turns:
        dones = [e for e in turn if e.type == "response.done"]
        assert dones
        for done in dones:
            assert done.response.status in ("completed", "incomplete"), done.response.status
            usage = done.response.usage
            assert usage is not None and usage.total_tokens == usage.input_tokens \
                + usage.output_tokens
            # within the bound: the frames it ran, at most max_response_seconds' worth
            assert 1 <= usage.input_tokens <= BOUND_FRAMES + 1


def test_push_to_talk_sends_no_error_and_the_session_stays_open(push_to_talk):
    assert not [e for e in _sdk_events(push_to_talk) if e.type == "error"]
    assert _sdk_events(push_to_talk)[-1].type == "session.updated"


def test_push_to_talk_answers_with_audio(push_to_talk):
    """The tiny model speaks at once: each turn's response carries audio."""
    for turn in _turns(push_to_talk):
        assert [e for e in turn if e.type == "response.output_audio.delta"]


def check_event_order(events) -> int:
    """Each response's .done events close what its .added events opened; its count."""
    opened: dict[str, set] = defaultdict(set)
    closed_responses = []
    for event in events:
        kind = event.type
        rid = getattr(event, "response_id", None)
        if kind == "response.created":
            assert event.response.id not in opened
            opened[event.response.id] = {"response"}
        elif kind == "response.output_item.added":
            assert "response" in opened[rid]
            opened[rid].add(("item", event.item.id))
        elif kind == "response.content_part.added":
            assert ("item", event.item_id) in opened[rid]
            opened[rid].add(("part", event.item_id))
        elif kind in ("response.output_audio.delta", "response.output_audio_transcript.delta"):
            assert ("part", event.item_id) in opened[rid], kind
            opened[rid].add((kind.removesuffix(".delta"), event.item_id))
        elif kind in ("response.output_audio.done", "response.output_audio_transcript.done"):
            opened[rid].discard((kind.removesuffix(".done"), event.item_id))
        elif kind == "response.content_part.done":
            assert not {o for o in opened[rid] if isinstance(o, tuple)
                        and o[0].startswith("response.output_audio") and o[1] == event.item_id}
            opened[rid].remove(("part", event.item_id))
        elif kind == "response.output_item.done":
            assert ("part", event.item.id) not in opened[rid]
            opened[rid].remove(("item", event.item.id))
        elif kind == "response.done":
            assert opened[event.response.id] == {"response"}, opened[event.response.id]
            del opened[event.response.id]
            closed_responses.append(event.response.id)
            assert event.response.usage is not None
    assert not opened, f"responses never done: {dict(opened)}"
    return len(closed_responses)


def test_push_to_talk_done_events_close_what_was_opened(push_to_talk):
    assert check_event_order(_sdk_events(push_to_talk)) >= 2


async def _server_vad(server, tmp_path) -> list:
    """A continuous stream with pauses (speech, silence, speech, silence), then the
    client stops sending and waits for every response to end."""
    stream = _speech(tmp_path / "a.wav", 1.5) + _silence(1.2) + _speech(tmp_path / "b.wav", 1.5) \
        + _silence(1.2)
    events: list = []
    client = openai.AsyncOpenAI(api_key=API_KEY, base_url=base_url(server))
    async with client.realtime.connect(model=MODEL) as connection:
        await connection.session.update(session=_session({"type": "server_vad"}))

        async def send():
            for chunk in _chunks(stream):
                await connection.input_audio_buffer.append(audio=chunk)
            # answered in order, once the server has run all the audio before it
            await connection.conversation.item.delete(item_id="item_end_of_stream")

        sender = asyncio.ensure_future(send())

        async def receive():
            created, done, streamed = set(), set(), False
            while not streamed or created - done:
                event = await connection.recv()
                events.append(event)
                if event.type == "response.created":
                    created.add(event.response.id)
                elif event.type == "response.done":
                    done.add(event.response.id)
                streamed = streamed or event.type == "conversation.item.deleted"

        await asyncio.wait_for(receive(), TURN_TIMEOUT)
        await sender
    return events


def test_server_vad_every_response_reaches_response_done(server, tmp_path):
    server.wait_idle()
    events = asyncio.run(_server_vad(server, tmp_path))
    assert [e for e in events if e.type == "input_audio_buffer.speech_started"]
    assert check_event_order(events) >= 1
    assert not [e for e in events if e.type == "error"]


def test_one_client_object_lists_models_transcribes_and_talks(server, tmp_path):
    wav = question_wav_24k(tmp_path / "q.wav", 1.0)
    client = openai.AsyncOpenAI(api_key=API_KEY, base_url=base_url(server))

    async def run():
        models = await client.models.list()
        retrieved = await client.models.retrieve(MODEL)
        transcript = await client.audio.transcriptions.create(
            model=MODEL, file=("q.wav", io.BytesIO(wav.read_bytes()), "audio/wav"))
        async with client.realtime.connect(model=MODEL) as connection:
            created = await asyncio.wait_for(connection.recv(), TURN_TIMEOUT)
        return models, retrieved, transcript, created

    server.wait_idle()
    models, retrieved, transcript, created = asyncio.run(run())
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by
    assert retrieved.id == MODEL
    assert isinstance(transcript.text, str)
    assert created.type == "session.created" and created.session.model == MODEL
