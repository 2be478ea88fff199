"""Calls that fail safely: arguments under the tool's JSON Schema, typed failures, bounded results."""

from __future__ import annotations

import json

import pytest

from mlx_voicechat_plugin.runtime.tool_failures import (
    FAILURE_TYPES,
    TOO_LARGE,
    ToolFailure,
    bounded_output,
)
from mlx_voicechat_plugin.runtime.tools import ToolError, ToolSet, parse_call, schema_errors


def test_arguments_are_checked_by_a_full_json_schema_validator():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1},
                                               "tag": {"type": "string", "pattern": "^[a-z]+$"},
                                               "pick": {"anyOf": [{"type": "string"},
                                                                  {"type": "null"}]}},
              "additionalProperties": False}
    assert schema_errors({"n": 2, "tag": "ab", "pick": None}, schema) == []
    errors = schema_errors({"n": 0, "tag": "A1", "pick": 3, "extra": 1}, schema)
    assert len(errors) == 4, errors
    assert any(e.startswith("arguments.n:") and "minimum" in e for e in errors)
    assert any("unexpected property 'extra'" in e for e in errors)


def test_a_call_whose_arguments_break_the_schema_never_becomes_a_call():
    tools = ToolSet([{"name": "book", "parameters": {
        "type": "object", "properties": {"people": {"type": "integer", "maximum": 12}},
        "required": ["people"]}}])
    error = parse_call({"name": "book", "arguments": {"people": 40}}, tools)
    assert error.reason == "schema" and "maximum" in error.message


def test_a_tool_with_an_invalid_json_schema_is_refused_at_registration():
    with pytest.raises(ToolError, match="not a valid JSON schema"):
        ToolSet([{"name": "x", "parameters": {"type": "object", "minProperties": "two"}}])


@pytest.mark.parametrize("kind", FAILURE_TYPES)
def test_each_failure_is_a_json_error_the_model_hears(kind):
    output = json.loads(ToolFailure(kind, "why").output())
    assert output == {"error": {"type": kind, "message": "why"}}


def test_an_unknown_failure_type_is_a_bug():
    with pytest.raises(ValueError):
        ToolFailure("oops", "why")


def test_a_failure_message_is_bounded():
    assert len(ToolFailure(TOO_LARGE, "x" * 10_000).message) <= 300


def test_results_are_bounded_in_bytes():
    assert bounded_output('{"ok": 1}', 100) == '{"ok": 1}'
    with pytest.raises(ToolFailure) as caught:
        bounded_output("x" * (10 * 2**20), 4096)
    assert caught.value.type == TOO_LARGE and "4096" in caught.value.message


def test_non_ascii_results_are_escaped_for_the_checkpoint():
    assert bounded_output('{"city": "Z\u00fcrich"}') == '{"city": "Z\\u00fcrich"}'
    assert bounded_output("Caf\u00e9") == '"Caf\\u00e9"'
    with pytest.raises(ToolFailure):  # escaping may push it past the bound
        bounded_output("\u00e9" * 100, 300)
