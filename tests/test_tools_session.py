"""Tool calling on the live timeline: scripted function-channel calls, result injection,
and the offline two-pass flow."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tool_support import RESULT, VALID, WEATHER, Script, short_tool_prompt

from mlx_voicechat_plugin.runtime.events import (
    Audio,
    FunctionDelta,
    ToolCall,
    ToolCallInvalid,
    ToolResultInjected,
    ToolsWarning,
)
from mlx_voicechat_plugin.runtime.tools import ToolError, render_tool_response
from mlx_voicechat_plugin.testing.fixtures import question_signal


@pytest.fixture(autouse=True)
def _short_prompt(monkeypatch):
    short_tool_prompt(monkeypatch)


@pytest.fixture(scope="module")
def session(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


def _script(session, monkeypatch, text: str, start: int = 2) -> Script:
    return Script(session.tokenizer, session.config.pad_token_id, text, start).install(monkeypatch)


def _frames(stream, count: int) -> list:
    events = []
    signal = question_signal(count * 0.08 + 0.1)
    for i in range(count):
        events += stream.push_audio(signal[i * 1280 : (i + 1) * 1280])
    return events


def _of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def test_valid_call_becomes_one_tool_call_event(session, monkeypatch):
    script = _script(session, monkeypatch, VALID)
    stream = session.create_streaming_session(tools=[WEATHER])
    events = _frames(stream, script.start + len(script.tokens) + 2)
    (call,) = _of(events, ToolCall)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.frame_index == script.start + len(script.tokens) - 1
    assert not _of(events, ToolCallInvalid)
    assert stream.function_text == VALID


@pytest.mark.parametrize(
    "text, reason",
    [
        ('<TOOLCALL>[{"name": "get_weather", "arguments": {]</TOOLCALL>', "malformed"),
        ('<TOOLCALL>[{"name": "get_time", "arguments": {}}]</TOOLCALL>', "unknown_tool"),
        ('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": 5}}]</TOOLCALL>', "schema"),
    ],
)
def test_bad_calls_become_errors_and_never_calls(session, monkeypatch, text, reason):
    script = _script(session, monkeypatch, text)
    stream = session.create_streaming_session(tools=[WEATHER])
    events = _frames(stream, script.start + len(script.tokens) + 1)
    assert not _of(events, ToolCall)
    (error,) = _of(events, ToolCallInvalid)
    assert error.reason == reason and error.code == "tool_call_invalid" and error.raw


def test_runaway_repeated_calls_are_capped(session, monkeypatch):
    script = _script(session, monkeypatch, VALID * 3)
    stream = session.create_streaming_session(tools=[WEATHER], max_tool_calls_per_turn=2)
    events = _frames(stream, script.start + len(script.tokens) + 1)
    assert len(_of(events, ToolCall)) == 2
    assert [e.reason for e in _of(events, ToolCallInvalid)] == ["limit"]


def test_result_is_injected_on_the_function_input_at_the_next_frames(session, monkeypatch):
    script = _script(session, monkeypatch, VALID)
    stream = session.create_streaming_session(tools=[WEATHER])
    events = _frames(stream, script.start + len(script.tokens))
    (call,) = _of(events, ToolCall)
    count = stream.submit_tool_result(call.call_id, RESULT)
    tokens = session.tokenizer.encode(render_tool_response(RESULT), add_special_tokens=False)
    assert count == len(tokens)

    submitted_at = len(script.inputs)
    later = _frames(stream, len(tokens) + 2)
    assert script.forced[submitted_at : submitted_at + len(tokens)] == tokens
    assert script.forced[submitted_at + len(tokens)] is None  # the model is free again
    # Each forced token is the next position's previous-function input.
    assert script.inputs[submitted_at + 1 : submitted_at + len(tokens) + 1] == tokens
    (done,) = _of(later, ToolResultInjected)
    assert done.call_id == call.call_id and done.num_tokens == len(tokens)
    assert (done.first_frame, done.frame_index) == (submitted_at, submitted_at + len(tokens) - 1)
    # Audio keeps flowing, and injected tokens are not echoed as function output.
    assert len(_of(later, Audio)) == len(tokens) + 2
    assert not _of(later, FunctionDelta)


def test_unknown_or_duplicate_call_id_is_an_error(session, monkeypatch):
    script = _script(session, monkeypatch, VALID)
    stream = session.create_streaming_session(tools=[WEATHER])
    (call,) = _of(_frames(stream, script.start + len(script.tokens)), ToolCall)
    with pytest.raises(ToolError, match="unknown tool call id"):
        stream.submit_tool_result("call_nope", RESULT)
    stream.submit_tool_result(call.call_id, RESULT)
    with pytest.raises(ToolError, match="already has a result"):
        stream.submit_tool_result(call.call_id, RESULT)


def test_non_ascii_result_is_rejected(session, monkeypatch):
    script = _script(session, monkeypatch, VALID)
    stream = session.create_streaming_session(tools=[WEATHER])
    (call,) = _of(_frames(stream, script.start + len(script.tokens)), ToolCall)
    with pytest.raises(ToolError, match="ASCII"):
        stream.submit_tool_result(call.call_id, '{"temp": "21\u00b0"}')
    stream.submit_tool_result(call.call_id, RESULT)  # the call is still open


def test_result_without_tools_is_tools_not_set(session):
    stream = session.create_streaming_session()
    with pytest.raises(ToolError, match="tools_not_set"):
        stream.submit_tool_result("call_x", RESULT)


def test_non_ascii_system_prompt_with_tools_is_rejected(session):
    with pytest.raises(ToolError, match="ASCII"):
        session.create_streaming_session(tools=[WEATHER], system_prompt="Caf\u00e9 helper.")


def test_many_tools_warn_in_the_first_frame(session):
    tools = [{"name": f"tool_{i}"} for i in range(6)]
    stream = session.create_streaming_session(tools=tools)
    (warning,) = _of(_frames(stream, 1), ToolsWarning)
    assert warning.frame_index == 0 and "6 tools" in warning.message


def test_tools_change_the_prompt_prefill(session):
    plain = session.create_streaming_session(system_prompt="Hi.")
    with_tools = session.create_streaming_session(system_prompt="Hi.", tools=[WEATHER])
    timelines = [s.conversation.compute.timeline for s in (with_tools, plain)]
    assert timelines[0].positions > timelines[1].positions


def test_offline_two_pass_flow_injects_the_response(session, monkeypatch):
    script = _script(session, monkeypatch, VALID)
    audio = question_signal(1.0)
    first = session.generate(audio, tools=[WEATHER], extra_decoding_seconds=8.0)
    (call,) = first.tool_calls
    assert call.frame_index == script.start + len(script.tokens) - 1

    script.inputs.clear(), script.forced.clear()
    second = session.generate(audio, tools=[WEATHER], tool_response=RESULT, extra_decoding_seconds=8.0)
    tokens = session.tokenizer.encode(render_tool_response(RESULT), add_special_tokens=False)
    start = call.frame_index + 1
    assert script.forced[start : start + len(tokens)] == tokens
    assert second.function_tokens[start : start + len(tokens)].tolist() == tokens
    assert second.function_text == VALID  # injected tokens are input, not output
    # Up to the call both passes are the same timeline.
    assert np.array_equal(first.audio_codes[:start], second.audio_codes[:start])


def test_offline_tool_response_without_tools_is_rejected(session):
    with pytest.raises(ValueError, match="tools_not_set"):
        session.generate(question_signal(0.5), tool_response=RESULT)
