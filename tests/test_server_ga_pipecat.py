"""Pipecat's OpenAI realtime LLM service, in a headless pipeline, against our GA route.

The service's own receive loop parses every server event with Pipecat's event
models (an event it cannot parse raises and ends its session); the test
records what it parsed and what reached the function handler.
"""

from __future__ import annotations

import asyncio

import pytest
from ga_support import (
    API_KEY,
    MODEL,
    base_url,
    call_frames,
    ga_server,
    question_wav_24k,
    scripted_call,
    silence_chunks,
    wav_chunks,
)
from tool_support import WEATHER

pytest.importorskip("pipecat")
realtime_llm = pytest.importorskip("pipecat.services.openai.realtime.llm")
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema  # noqa: E402
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema  # noqa: E402
from pipecat.frames.frames import EndFrame, InputAudioRawFrame, LLMContextFrame  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.runner import PipelineRunner  # noqa: E402
from pipecat.pipeline.task import PipelineParams, PipelineTask  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.services.openai.realtime import events  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    yield from ga_server(tiny_ckpt)


def _weather_tool() -> ToolsSchema:
    parameters = WEATHER["parameters"]
    return ToolsSchema(standard_tools=[FunctionSchema(
        name=WEATHER["name"], description=WEATHER["description"],
        properties=parameters["properties"], required=parameters["required"])])


def _open_responses(parsed: list) -> set[str]:
    events = [e for e in parsed if e is not None]
    return {e.response.id for e in events if e.type == "response.created"} \
        - {e.response.id for e in events if e.type == "response.done"}


async def _run(server, wav, parsed: list, failures: list, calls: list, errors: list,
               sent: list, state: dict) -> None:
    called = asyncio.Event()
    llm = realtime_llm.OpenAIRealtimeLLMService(
        api_key=API_KEY, base_url=base_url(server).replace("http", "ws", 1) + "/realtime",
        settings=realtime_llm.OpenAIRealtimeLLMService.Settings(
            model=MODEL, system_instruction="Be brief."))

    async def get_weather(params) -> None:
        calls.append((params.function_name, dict(params.arguments)))
        await params.result_callback({"temp": 21})
        called.set()

    llm.register_function("get_weather", get_weather)
    send_client_event = llm.send_client_event

    async def recording_send(event):
        sent.append(event.type)
        await send_client_event(event)

    llm.send_client_event = recording_send
    task = PipelineTask(Pipeline([llm]), params=PipelineParams(audio_in_sample_rate=24_000),
                        enable_rtvi=False, check_dangling_tasks=False,
                        cancel_on_idle_timeout=False)

    @task.event_handler("on_pipeline_error")
    async def on_error(_task, frame):
        errors.append(frame)

    runner = PipelineRunner(handle_sigint=False)
    running = asyncio.ensure_future(runner.run(task))
    context = LLMContext(messages=[], tools=_weather_tool())
    await task.queue_frame(LLMContextFrame(context))
    # A transport would stream at once; waiting for the tools to be set keeps the
    # scripted call inside one model timeline (a later tool change restarts it).
    while not any(e is not None and e.type == "session.updated" and e.session.tools
                  for e in parsed):
        await asyncio.sleep(0.02)
    for chunk in wav_chunks(wav) + silence_chunks(0.5):
        await task.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=24_000,
                                                  num_channels=1))
    await asyncio.wait_for(called.wait(), 30)
    for chunk in silence_chunks(1.0):
        await task.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=24_000,
                                                  num_channels=1))
    # Pipecat holds each response.create until that response is done: wait until
    # it holds none, every response the server created is done, and the tool
    # result it sends after the handler returned has been answered (Pipecat sends
    # it on its own task, so a quiet moment can come before it).
    for _ in range(600):
        await asyncio.sleep(0.05)
        if not llm._response_active and not _open_responses(parsed) \
                and _tool_outputs_added(parsed):
            break
    state.update(active=llm._response_active, open=_open_responses(parsed))
    await task.queue_frame(EndFrame())
    await asyncio.wait_for(running, 30)


@pytest.fixture(scope="module")
def session(server, tmp_path_factory):
    import _pytest.monkeypatch

    patch = _pytest.monkeypatch.MonkeyPatch()
    parsed: list = []
    failures: list = []
    original = events.parse_server_event

    def recording(text):
        try:
            event = original(text)
        except Exception as exc:  # what would end Pipecat's receive loop
            failures.append(exc)
            raise
        parsed.append(event)
        return event

    try:
        patch.setattr(realtime_llm.events, "parse_server_event", recording)
        script = scripted_call(server, patch)
        wav = question_wav_24k(tmp_path_factory.mktemp("pipecat") / "q24k.wav",
                               call_frames(script) * 0.08 + 0.5)
        server.wait_idle()
        calls: list = []
        errors: list = []
        sent: list = []
        state: dict = {}
        asyncio.run(_run(server, wav, parsed, failures, calls, errors, sent, state))
        return {"parsed": parsed, "failures": failures, "calls": calls, "errors": errors,
                "sent": sent, **state}
    finally:
        patch.undo()


def _types(session) -> list[str]:
    return [event.type for event in session["parsed"] if event is not None]


def test_every_server_event_parses_as_a_pipecat_event(session):
    assert session["failures"] == []
    assert all(event is not None for event in session["parsed"])


def test_the_session_is_configured_with_our_tool(session):
    updated = [e for e in session["parsed"] if e.type == "session.updated"]
    assert updated and updated[-1].session.instructions == "Be brief."
    assert updated[-1].session.audio.output.format.rate == 24000


def test_the_function_call_reaches_its_handler(session):
    assert session["calls"] == [("get_weather", {"city": "Paris"})]


def test_audio_and_transcripts_arrive_inside_responses(session):
    kinds = _types(session)
    assert "response.output_audio.delta" in kinds
    assert "response.output_audio_transcript.delta" in kinds
    assert kinds.index("response.created") < kinds.index("response.output_audio.delta")
    assert "conversation.item.input_audio_transcription.delta" in kinds


def _tool_outputs_added(parsed) -> list:
    return [e for e in parsed if e is not None and e.type == "conversation.item.added"
            and e.item.type == "function_call_output"]


def test_the_tool_result_is_accepted_as_a_conversation_item(session):
    assert len(_tool_outputs_added(session["parsed"])) == 1


def test_no_error_reached_the_pipeline(session):
    assert "error" not in _types(session)
    assert session["errors"] == []


def test_every_response_pipecat_asked_for_was_created_and_done(session):
    kinds = _types(session)
    assert session["sent"].count("response.create") >= 1
    assert kinds.count("response.created") >= session["sent"].count("response.create")
    assert session["open"] == set()  # every response.created has its response.done
    assert session["active"] is False  # Pipecat holds no response open: it did not hang
