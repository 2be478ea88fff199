"""Tool definitions and the call format: validation, the system-prompt rendering,
parsing a call block and checking its arguments against the tool's schema.

The checkpoint learned tool calling from system prompts rendered by NeMo's
voicechat tool-calling chat template: the plain system message, then (when
tools exist) a fixed instruction block that lists the tools as
``<AVAILABLE_TOOLS>[...]</AVAILABLE_TOOLS>``, shows the
``<TOOLCALL>[{"name": ..., "arguments": ...}]</TOOLCALL>`` call format and the
``<TOOL_RESPONSE>[...]</TOOL_RESPONSE>`` answer format. Each tool is written
with Jinja's ``tojson`` (sorted keys, HTML-safe escapes), every key but
``type``. :func:`render_system_prompt` reproduces that text byte for byte.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass
from typing import Any

from ..quoting import brief, cut

logger = logging.getLogger(__name__)

TOOLCALL_START = "<TOOLCALL>"
TOOLCALL_END = "</TOOLCALL>"
TOOL_RESPONSE_START = "<TOOL_RESPONSE>"
TOOL_RESPONSE_END = "</TOOL_RESPONSE>"

# Above this many tools the checkpoint is out of its training distribution.
RECOMMENDED_MAX_TOOLS = 5
DEFAULT_MAX_TOOLS = 32

_TOOLS_INTRO = "You can use the following tools to assist the user if required:"
_CALL_FORMAT = (
    "If you decide to call any tool(s), use the following format:\n"
    '<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, '
    '{"name": "tool_name2", "arguments": "tool_args2"}]</TOOLCALL>\n\n'
)
_RESPONSE_FORMAT = (
    "The user will execute tool-calls and return responses from tool(s) in this format:\n"
    '<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>\n\n'
)
_DECISION = (
    "Based on the tool responses, you can call additional tools if needed, "
    "correct tool calls if any errors are found, or just respond to the user."
)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")  # the whole name (fullmatch)
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "ack_messages"})
_EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A tool definition, system prompt or tool result is not acceptable."""


def require_ascii(text: str, what: str) -> str:
    """``text`` unchanged if it is an ASCII string, else :class:`ToolError`."""
    if not isinstance(text, str):
        raise ToolError(f"{what} must be a string, got {type(text).__name__}")
    if not text.isascii():
        bad = next(c for c in text if not c.isascii())
        raise ToolError(
            f"{what} must be ASCII (the checkpoint was trained on ASCII tool text); "
            f"found {bad!r} at position {text.index(bad)}"
        )
    return text


def jinja_tojson(value: Any) -> str:
    """Jinja's ``tojson`` filter: sorted keys, then ``< > & '`` as ``\\u`` escapes."""
    text = json.dumps(value, sort_keys=True)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("'", "\\u0027")):
        text = text.replace(char, escape)
    return text


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    ack_messages: tuple[str, ...] | None = None

    def rendered(self) -> dict[str, Any]:
        """The dict the template writes: every key but ``type``."""
        return {key: value for key, value in asdict(self).items() if value is not None}


def _check_ascii_tree(value: Any, where: str) -> None:
    if isinstance(value, str):
        require_ascii(value, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            require_ascii(key, f"{where} key")
            _check_ascii_tree(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_ascii_tree(item, f"{where}[{i}]")


def parse_tool(spec: Any, index: int) -> Tool:
    """One tool from a flat dict or the OpenAI ``{"type": "function", "function": {...}}`` form."""
    where = f"tools[{index}]"
    if not isinstance(spec, dict):
        raise ToolError(f"{where} must be an object, got {type(spec).__name__}")
    if "function" in spec and isinstance(spec["function"], dict):
        spec = {**spec["function"], **({"type": spec["type"]} if "type" in spec else {})}
    unknown = set(spec) - _TOOL_KEYS
    if unknown:
        raise ToolError(f"{where} has {len(unknown)} unknown key(s), e.g. "
                        f"{brief(sorted(map(str, unknown))[0])}; allowed: {sorted(_TOOL_KEYS)}")
    if spec.get("type", "function") != "function":
        raise ToolError(f"{where}.type must be 'function', got {spec['type']!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(f"{where}.name must match {_NAME.pattern}, got {brief(name)}")
    description = spec.get("description", "")
    require_ascii(description, f"{where}.description")
    parameters = spec.get("parameters", _EMPTY_OBJECT)
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.parameters must be a JSON-schema object, "
                        f"got {type(parameters).__name__}")
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as exc:
        raise ToolError(f"{where}.parameters is not a valid JSON schema: "
                        f"{cut(exc.message, 200)}") from None
    if parameters.get("type", "object") != "object":
        raise ToolError(f"{where}.parameters.type must be 'object'")
    _check_ascii_tree(parameters, f"{where}.parameters")
    acks = spec.get("ack_messages")
    if acks is not None:
        if not isinstance(acks, list):
            raise ToolError(f"{where}.ack_messages must be a list of strings")
        acks = tuple(require_ascii(ack, f"{where}.ack_messages[{i}]")
                     for i, ack in enumerate(acks))
    return Tool(name, description, parameters, acks)


class ToolSet(dict[str, Tool]):
    """Validated tools by name, in order; ``warnings`` lists soft-limit notices."""

    def __init__(self, specs: list[Any], max_tools: int = DEFAULT_MAX_TOOLS):
        super().__init__()
        if not isinstance(specs, list):
            raise ToolError(f"tools must be a list, got {type(specs).__name__}")
        if len(specs) > max_tools:
            raise ToolError(f"{len(specs)} tools given; at most {max_tools} are allowed")
        for i, spec in enumerate(specs):
            tool = parse_tool(spec, i)
            if tool.name in self:
                raise ToolError(f"tools[{i}]: duplicate tool name {tool.name!r}")
            self[tool.name] = tool
        self.warnings: list[str] = []
        if len(self) > RECOMMENDED_MAX_TOOLS:
            message = (
                f"{len(self)} tools registered; the checkpoint was trained with at most "
                f"{RECOMMENDED_MAX_TOOLS} and may call them less reliably"
            )
            logger.warning(message)
            self.warnings.append(message)


def render_system_prompt(system_message: str, tools: ToolSet | None) -> str:
    """The system prompt with the tool block appended, as the checkpoint saw it."""
    require_ascii(system_message, "system prompt")
    if not tools:
        return system_message
    head = system_message + "\n\n" if system_message else ""
    listed = ", ".join(jinja_tojson(tool.rendered()) for tool in tools.values())
    return (f"{head}{_TOOLS_INTRO}\n<AVAILABLE_TOOLS>[{listed}]</AVAILABLE_TOOLS>\n\n"
            f"{_CALL_FORMAT}{_RESPONSE_FORMAT}{_DECISION}")


def render_tool_response(output: str) -> str:
    """One tool result as ``<TOOL_RESPONSE>[...]</TOOL_RESPONSE>``.

    A JSON output is inserted as written; any other text is JSON-quoted so the
    list stays valid JSON.
    """
    require_ascii(output, "tool result")
    try:
        json.loads(output)
        body = output.strip()
    except ValueError:
        body = json.dumps(output)
    return f"{TOOL_RESPONSE_START}[{body}]{TOOL_RESPONSE_END}"


# --- arguments ---------------------------------------------------------


def _message(error: Any) -> str:
    """One violation in this module's words (jsonschema's own for the rarer keywords)."""
    if error.validator == "type":
        kinds = error.validator_value
        kinds = kinds if isinstance(kinds, list) else [kinds]
        return f"expected {' or '.join(kinds)}, got {type(error.instance).__name__}"
    if error.validator == "required":
        missing = next((k for k in error.validator_value if k not in error.instance), "?")
        return f"missing required property {missing!r}"
    if error.validator == "enum":
        return f"{error.instance!r} is not one of {error.validator_value!r}"
    if error.validator == "additionalProperties" and error.validator_value is False:
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        return f"unexpected property {brief(extra[0]) if extra else '?'}"
    return cut(error.message, 200)


def schema_errors(value: Any, schema: dict[str, Any], path: str = "arguments") -> list[str]:
    """What is wrong with ``value`` under the JSON Schema ``schema`` (jsonschema, draft
    2020-12), one line per violation, each naming where (``arguments.xs[1]``)."""
    from jsonschema import Draft202012Validator

    errors = sorted(Draft202012Validator(schema).iter_errors(value),
                    key=lambda e: list(e.absolute_path))
    return [path + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
            + f": {_message(e)}" for e in errors]


def coerce_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Top-level string values to the declared number/integer/boolean type.

    Speech models often write ``"5"`` for ``5``; NeMo's voicechat tool-call
    parser coerces these before dispatch, and so do we. Anything that does not
    convert cleanly is left for the validator to reject.
    """
    props = schema.get("properties", {})
    out = dict(arguments)
    for key, value in arguments.items():
        kind = props.get(key, {}).get("type") if isinstance(props.get(key), dict) else None
        if not isinstance(value, str) or kind not in ("integer", "number", "boolean"):
            continue
        text = value.strip()
        if kind == "boolean" and text.lower() in ("true", "false"):
            out[key] = text.lower() == "true"
        elif kind == "integer" and re.fullmatch(r"[+-]?\d+", text):
            out[key] = int(text)
        elif kind == "number" and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text):
            out[key] = float(text)
    return out


# --- one call block ------------------------------------------------------


@dataclass(frozen=True)
class ParsedCall:
    """A schema-valid call: the tool's name and its (coerced) arguments."""

    name: str
    arguments: dict[str, Any]
    raw: str


@dataclass(frozen=True)
class CallError:
    """An element of a block that is not a valid call (``reason``: see ``ToolCallInvalid``)."""

    reason: str
    message: str
    raw: str


def parse_call_block(body: str, tools: ToolSet) -> list[ParsedCall | CallError]:
    """The calls of one ``<TOOLCALL>...</TOOLCALL>`` body, each parsed and checked."""
    text = body.strip()
    # Like NeMo's parser, tolerate a block whose list brackets were dropped.
    candidate = text if text.startswith("[") else "[" + text
    candidate = candidate if candidate.endswith("]") else candidate + "]"
    try:
        items = json.loads(candidate)
    except ValueError as exc:
        return [CallError("malformed", f"not JSON: {exc}", body)]
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list):
        return [CallError("malformed", "expected a list of calls", body)]
    return [parse_call(item, tools) for item in items]


def parse_call(item: Any, tools: ToolSet) -> ParsedCall | CallError:
    """One decoded call element: a known tool, JSON-object arguments valid under its schema."""
    raw = json.dumps(item)
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return CallError("malformed", "a call needs a string 'name'", raw)
    name = item["name"]
    if name not in tools:
        return CallError("unknown_tool", f"no tool named {name!r}", raw)
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return CallError("malformed", "arguments are not JSON", raw)
    if not isinstance(arguments, dict):
        return CallError("malformed", "arguments must be a JSON object", raw)
    schema = tools[name].parameters
    arguments = coerce_arguments(arguments, schema)
    errors = schema_errors(arguments, schema)
    if errors:
        return CallError("schema", "; ".join(errors), raw)
    return ParsedCall(name, arguments, raw)
