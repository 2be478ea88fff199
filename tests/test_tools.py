"""Tool definitions, the rendered system prompt, argument schemas and call parsing."""

from __future__ import annotations

import json

import pytest

from mlx_voicechat_plugin.runtime.events import ToolCall, ToolCallInvalid
from mlx_voicechat_plugin.runtime.tool_calls import ToolChannel
from mlx_voicechat_plugin.runtime.tools import (
    RECOMMENDED_MAX_TOOLS,
    ToolError,
    ToolSet,
    render_system_prompt,
    render_tool_response,
    schema_errors,
)

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"},
        },
        "required": ["city"],
    },
    "ack_messages": ["Let me check the weather."],
}


def _call(name: str, arguments) -> str:
    return "<TOOLCALL>" + json.dumps([{"name": name, "arguments": arguments}]) + "</TOOLCALL>"


def _parser(**kwargs) -> ToolChannel:
    return ToolChannel(ToolSet([WEATHER]), None, **kwargs)


# --- the prompt ---------------------------------------------------------------


def test_prompt_renders_the_training_template():
    prompt = render_system_prompt("You are helpful.", ToolSet([WEATHER]))
    tool = (
        '{"ack_messages": ["Let me check the weather."], "description": "Current weather for a city.", '
        '"name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}, '
        '"days": {"type": "integer"}, "unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}}, '
        '"required": ["city"], "type": "object"}}'
    )
    assert prompt == (
        "You are helpful.\n\n"
        "You can use the following tools to assist the user if required:\n"
        f"<AVAILABLE_TOOLS>[{tool}]</AVAILABLE_TOOLS>\n\n"
        "If you decide to call any tool(s), use the following format:\n"
        '<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, '
        '{"name": "tool_name2", "arguments": "tool_args2"}]</TOOLCALL>\n\n'
        "The user will execute tool-calls and return responses from tool(s) in this format:\n"
        '<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>\n\n'
        "Based on the tool responses, you can call additional tools if needed, "
        "correct tool calls if any errors are found, or just respond to the user."
    )


def test_empty_system_message_has_no_leading_blank_line():
    assert render_system_prompt("", ToolSet([WEATHER])).startswith("You can use the following tools")


def test_openai_function_form_is_accepted():
    tools = ToolSet([{"type": "function", "function": {"name": "ping", "description": "Ping."}}])
    assert tools["ping"].parameters == {"type": "object", "properties": {}}


def test_tojson_escapes_html_characters_like_jinja():
    tools = ToolSet([{"name": "cmp", "description": "a<b & c>d 'q'"}])
    assert "a\\u003cb \\u0026 c\\u003ed \\u0027q\\u0027" in render_system_prompt("", tools)


def test_non_ascii_system_prompt_is_rejected():
    with pytest.raises(ToolError, match="system prompt must be ASCII"):
        render_system_prompt("Sois poli, s'il te pla\u00eet.", ToolSet([WEATHER]))


def test_non_ascii_tool_description_is_rejected():
    with pytest.raises(ToolError, match="ASCII"):
        ToolSet([{**WEATHER, "description": "M\u00e9t\u00e9o"}])


def test_non_ascii_tool_result_is_rejected():
    with pytest.raises(ToolError, match="tool result must be ASCII"):
        render_tool_response('{"temp": "20\u00b0C"}')


def test_more_than_five_tools_warns():
    tools = ToolSet([{"name": f"t{i}"} for i in range(RECOMMENDED_MAX_TOOLS + 1)])
    assert len(tools.warnings) == 1 and "6 tools" in tools.warnings[0]


def test_hard_tool_limit_rejects():
    with pytest.raises(ToolError, match="at most 3"):
        ToolSet([{"name": f"t{i}"} for i in range(4)], max_tools=3)


def test_duplicate_and_badly_named_tools_are_rejected():
    with pytest.raises(ToolError, match="duplicate"):
        ToolSet([WEATHER, WEATHER])
    with pytest.raises(ToolError, match="name"):
        ToolSet([{"name": "has space"}])


def test_tool_result_json_is_inserted_verbatim_and_text_is_quoted():
    assert render_tool_response('{"temp": 20}') == '<TOOL_RESPONSE>[{"temp": 20}]</TOOL_RESPONSE>'
    assert render_tool_response("sunny") == '<TOOL_RESPONSE>["sunny"]</TOOL_RESPONSE>'


# --- the schema ---------------------------------------------------------------


def test_schema_accepts_a_valid_object():
    assert schema_errors({"city": "Paris", "unit": "celsius"}, WEATHER["parameters"]) == []


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        ({}, "missing required property 'city'"),
        ({"city": 3}, "expected string"),
        ({"city": "Paris", "unit": "kelvin"}, "is not one of"),
        ({"city": "Paris", "days": 1.5}, "expected integer"),
        ({"city": "Paris", "days": True}, "expected integer"),
    ],
)
def test_schema_reports_violations(arguments, fragment):
    errors = schema_errors(arguments, WEATHER["parameters"])
    assert any(fragment in e for e in errors), errors


def test_schema_checks_arrays_and_booleans():
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "number"}},
                                               "on": {"type": "boolean"}}}
    assert schema_errors({"xs": [1, 2.5], "on": False}, schema) == []
    assert schema_errors({"xs": [1, "a"]}, schema) == ["arguments.xs[1]: expected number, got str"]


# --- the parser ---------------------------------------------------------------


def test_valid_call_becomes_a_tool_call():
    (event,) = _parser().observe(_call("get_weather", {"city": "Paris"}), 7)
    assert isinstance(event, ToolCall)
    assert event.name == "get_weather" and event.frame_index == 7
    assert json.loads(event.arguments) == {"city": "Paris"}
    assert event.call_id.startswith("call_") and len(event.call_id) > len("call_")


def test_call_is_reported_only_once_it_is_complete():
    parser, text = _parser(), _call("get_weather", {"city": "Paris"})
    events = [e for i in range(1, len(text) + 1) for e in parser.observe(text[:i], i)]
    assert len(events) == 1 and events[0].frame_index == len(text)


def test_string_arguments_are_parsed_and_coerced():
    (event,) = _parser().observe(_call("get_weather", json.dumps({"city": "Oslo", "days": "3"})), 0)
    assert json.loads(event.arguments) == {"city": "Oslo", "days": 3}


def test_malformed_call_is_invalid_with_raw_text():
    (event,) = _parser().observe('<TOOLCALL>[{"name": "get_weather", "arguments": {</TOOLCALL>', 0)
    assert isinstance(event, ToolCallInvalid)
    assert event.reason == "malformed" and event.code == "tool_call_invalid"
    assert '"arguments": {' in event.raw


def test_unknown_tool_is_invalid():
    (event,) = _parser().observe(_call("launch_rocket", {}), 0)
    assert isinstance(event, ToolCallInvalid) and event.reason == "unknown_tool"


def test_schema_invalid_arguments_are_invalid():
    (event,) = _parser().observe(_call("get_weather", {"city": "Paris", "unit": "kelvin"}), 0)
    assert isinstance(event, ToolCallInvalid) and event.reason == "schema"


def test_runaway_calls_stop_at_the_per_turn_cap():
    parser, text = _parser(max_calls_per_turn=2), ""
    events = []
    for i in range(4):
        text += _call("get_weather", {"city": "Paris"})
        events += parser.observe(text, i)
    assert [type(e) for e in events] == [ToolCall, ToolCall, ToolCallInvalid, ToolCallInvalid]
    assert events[-1].reason == "limit"
    parser.new_turn()
    text += _call("get_weather", {"city": "Rome"})
    assert isinstance(parser.observe(text, 9)[0], ToolCall)


def test_unterminated_call_is_reported_at_the_end():
    parser, text = _parser(), '<TOOLCALL>[{"name": "get_weather"'
    assert parser.observe(text, 0) == []
    (event,) = parser.finish(text, 3)
    assert event.reason == "unterminated" and event.raw == '[{"name": "get_weather"'


def test_text_outside_blocks_is_ignored():
    assert _parser().observe("just some words", 0) == []
