"""A GPT-Live session's configuration: ``session.start`` read strictly, ``session.update``
merged, and the resolved session object ``session.started`` reports.

As the openai package types it (``openai.types.live.SessionConfig``): ``model``
(required; any name opens the served model, reported as its id), ``instructions``,
``audio.format`` (``audio/pcm`` at 16 or 24 kHz, ``audio/pcmu``, ``audio/pcma``; one
format both ways, immutable) and ``audio.output.voice`` (echoed: the model has one
voice), ``input`` (text history, at most 128 messages of one text part), ``delegation``
(``null`` / ``client``, or ``responses`` with function tools), ``safety_identifier``,
``store``, ``triggers`` and ``client``. A field the type does not name is
``unknown_parameter``, as OpenAI refuses it; a value of the wrong type, or one this
server cannot honour (a hosted Responses tool, Decisions delegation or triggers,
``store: true``, a frontend's ``client`` permissions, which nothing here would
enforce), is ``invalid_value`` naming its field: what ``session.started`` echoes is
always of its type. ``session.update`` takes only ``delegation`` (of the
same type) and ``triggers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ....quoting import brief
from ...wire import ProtocolError
from ..ga.audio import PCM, PCMA, PCMU, AudioFormat

DEFAULT_VOICE = "marin"
MAX_INPUT_MESSAGES = 128
PCM_RATES = (16_000, 24_000)
G711_RATE = 8_000
ROLES = ("developer", "user", "assistant")
# Fields of each object, as the openai package's types name them.
SESSION_FIELDS = ("model", "audio", "client", "delegation", "input", "instructions",
                  "safety_identifier", "store", "triggers")
MEDIA_FIELDS = ("idle_timeout_s", "wake_policy")  # a WebRTC session's only (no effect here)
UPDATE_FIELDS = ("delegation", "triggers")
AUDIO_FIELDS = ("format", "output")
RESPONSES_FIELDS = ("model", "instructions", "max_output_tokens", "parallel_tool_calls",
                    "reasoning", "service_tier", "text", "tool_choice", "tools")
FUNCTION_FIELDS = ("type", "name", "description", "parameters", "strict")
MESSAGE_FIELDS = ("role", "content", "id", "status", "type")
TOOL_CHOICES = ("auto", "none", "required")
PART_TYPES = {"developer": ("input_text",), "user": ("input_text",),
              "assistant": ("text", "output_text")}


class LiveError(ProtocolError):
    """A client mistake answered with GPT-Live's error (``param``: the field at fault)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(code, message)
        self.param = param


def unknown(where: str) -> LiveError:
    return LiveError("unknown_parameter", f"Unknown parameter: '{where}'.", where)


def bad(where: str, message: str) -> LiveError:
    return LiveError("invalid_value", f"Invalid value for '{where}': {message}", where)


def missing(where: str) -> LiveError:
    return LiveError("missing_required_parameter", f"Missing required parameter: '{where}'.",
                     where)


def strict_object(value: Any, where: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """``value`` as an object whose keys are all in ``fields`` (else ``unknown_parameter``)."""
    if not isinstance(value, dict):
        raise bad(where, f"expected an object, got {brief(value)}")
    for key in value:
        if key not in fields:
            raise unknown(f"{where}.{key}" if where else str(key))
    return value


def optional_str(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise bad(where, f"expected a string, got {brief(value)}")
    return value


def whole_ms(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(where, f"expected an integer >= 0, got {brief(value)}")
    return value


@dataclass(frozen=True)
class Delegation:
    """Who handles delegated work: ``client`` (no tools) or ``responses`` (function tools
    whose calls the client runs)."""

    type: str = "client"
    acknowledgement_delay_ms: int | None = None
    responses: dict[str, Any] | None = None  # as the client sent it, checked

    @property
    def tools(self) -> list[dict[str, Any]]:
        return list((self.responses or {}).get("tools") or [])

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.acknowledgement_delay_ms is not None:
            out["acknowledgement_delay_ms"] = self.acknowledgement_delay_ms
        if self.type == "responses":
            out["responses"] = dict(self.responses or {})
        return out


@dataclass(frozen=True)
class LiveConfig:
    """A started session's configuration."""

    model: str = ""
    instructions: str | None = None
    format: AudioFormat = field(default_factory=AudioFormat)
    voice: Any = DEFAULT_VOICE
    input: tuple[dict[str, Any], ...] = ()
    delegation: Delegation = field(default_factory=Delegation)
    safety_identifier: str | None = None

    def engine_tools(self) -> list[dict[str, Any]] | None:
        """The function tools as the runtime takes them (``None``: none)."""
        tools = [{k: v for k, v in tool.items() if k != "strict"}
                 for tool in self.delegation.tools]
        return tools or None

    def describe(self, session_id: str, model_id: str, expires_at: int) -> dict[str, Any]:
        """The ``SessionResource`` of ``session.started`` / ``updated`` / ``closed``."""
        out: dict[str, Any] = {
            "id": session_id, "expires_at": expires_at, "model": model_id, "status": "active",
            "audio": {"format": describe_format(self.format), "output": {"voice": self.voice}},
            "delegation": self.delegation.describe(), "input": list(self.input),
            "instructions": self.instructions or "", "store": False, "triggers": []}
        if self.safety_identifier is not None:
            out["safety_identifier"] = self.safety_identifier
        return out


def describe_format(fmt: AudioFormat) -> dict[str, Any]:
    return {"type": fmt.type, "rate": fmt.rate}


def parse_format(value: Any, where: str = "session.audio.format") -> AudioFormat:
    """``audio.format``: PCM16 at 16 or 24 kHz, or G.711 at 8 kHz."""
    fmt = strict_object(value, where, ("type", "rate"))
    kind, rate = fmt.get("type"), fmt.get("rate")
    if kind == PCM:
        rate = PCM_RATES[-1] if rate is None else rate
        if rate not in PCM_RATES or isinstance(rate, bool):
            raise bad(f"{where}.rate", f"audio/pcm takes 16000 or 24000, got {brief(rate)}")
        return AudioFormat(PCM, rate)
    if kind in (PCMU, PCMA):
        if rate not in (None, G711_RATE) or isinstance(rate, bool):
            raise bad(f"{where}.rate", f"{kind} is {G711_RATE} Hz, got {brief(rate)}")
        return AudioFormat(kind, G711_RATE)
    raise bad(f"{where}.type", f"expected one of '{PCM}', '{PCMU}', '{PCMA}', got "
                               f"{brief(kind)}")


def parse_tools(value: Any, where: str) -> list[dict[str, Any]]:
    """Function tools (the client runs them); a hosted tool cannot run here."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad(where, "expected an array of tools")
    tools = []
    for index, tool in enumerate(value):
        at = f"{where}[{index}]"
        if not isinstance(tool, dict):
            raise bad(at, "expected a tool object")
        if tool.get("type") != "function":
            raise bad(f"{at}.type", f"{brief(tool.get('type'))} is a hosted tool this server "
                                    "cannot run; only 'function' tools (run by the client)")
        strict_object(tool, at, FUNCTION_FIELDS)
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise missing(f"{at}.name")
        optional_str(tool.get("description"), f"{at}.description")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise bad(f"{at}.parameters", "expected a JSON Schema object")
        if not isinstance(tool.get("strict", False), (bool, type(None))):
            raise bad(f"{at}.strict", "expected a boolean")
        tools.append(dict(tool))
    return tools


def parse_responses(value: Any, where: str, current: dict[str, Any] | None
                    ) -> dict[str, Any]:
    """``delegation.responses``: its fields checked (``model`` required at start), merged
    over ``current`` for an update."""
    responses = strict_object(value, where, RESPONSES_FIELDS)
    merged = dict(current or {})
    merged.update(responses)
    if not isinstance(merged.get("model"), str) or not merged["model"]:
        raise missing(f"{where}.model")
    optional_str(merged.get("instructions"), f"{where}.instructions")
    optional_str(merged.get("service_tier"), f"{where}.service_tier")
    whole_ms(merged.get("max_output_tokens"), f"{where}.max_output_tokens")
    if not isinstance(merged.get("parallel_tool_calls", False), (bool, type(None))):
        raise bad(f"{where}.parallel_tool_calls", "expected a boolean")
    for name, fields in (("reasoning", ("effort", "summary")), ("text", ("verbosity",))):
        if merged.get(name) is not None:
            for key, value in strict_object(merged[name], f"{where}.{name}", fields).items():
                optional_str(value, f"{where}.{name}.{key}")
    choice = merged.get("tool_choice")
    if choice is not None and choice not in TOOL_CHOICES and not (
            isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("name"), str)
            and set(choice) <= {"type", "name"}):
        raise bad(f"{where}.tool_choice", "expected 'auto', 'none', 'required' or "
                                          "{\"type\": \"function\", \"name\": ...}: only "
                                          "function tools run here")
    merged["tools"] = parse_tools(merged.get("tools"), f"{where}.tools")
    return merged


def parse_delegation(value: Any, where: str, current: Delegation | None = None) -> Delegation:
    """``delegation``: ``null`` or ``client``, or ``responses``; an update keeps the type."""
    if value is None:
        if current is not None:
            return current
        return Delegation()
    if not isinstance(value, dict):
        raise bad(where, "expected an object")
    kind = value.get("type")
    if kind == "decisions":
        raise bad(f"{where}.type", "Decisions delegation needs OpenAI's Decisions backend, "
                                   "which this server does not have; use 'client' or "
                                   "'responses'")
    if kind not in ("client", "responses"):
        raise bad(f"{where}.type", f"expected 'client' or 'responses', got {brief(kind)}")
    if current is not None and kind != current.type:
        raise bad(f"{where}.type", f"the delegation type cannot change (it is "
                                   f"'{current.type}')")
    fields = ("type", "acknowledgement_delay_ms") + (("responses",) if kind == "responses"
                                                      else ())
    strict_object(value, where, fields)
    delay = whole_ms(value.get("acknowledgement_delay_ms"), f"{where}.acknowledgement_delay_ms")
    if delay is None and current is not None:
        delay = current.acknowledgement_delay_ms
    responses = None
    if kind == "responses":
        if "responses" not in value and current is None:
            raise missing(f"{where}.responses")
        responses = parse_responses(value.get("responses", {}), f"{where}.responses",
                                    current.responses if current is not None else None)
    return Delegation(kind, delay, responses)


def parse_triggers(value: Any, where: str) -> None:
    if value in (None, []):
        return
    raise bad(where, "triggers run OpenAI's Decisions backend, which this server does not "
                     "have; send [] or omit it")


def parse_input(value: Any, where: str = "session.input") -> tuple[dict[str, Any], ...]:
    """The text history: developer, user and assistant messages of one text part each."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad(where, "expected an array of messages")
    if len(value) > MAX_INPUT_MESSAGES:
        raise bad(where, f"at most {MAX_INPUT_MESSAGES} messages, got {len(value)}")
    for index, message in enumerate(value):
        at = f"{where}[{index}]"
        strict_object(message, at, MESSAGE_FIELDS)
        if message.get("role") not in ROLES:
            raise bad(f"{at}.role", f"expected one of {', '.join(ROLES)}, got "
                                    f"{brief(message.get('role'))}")
        content = message.get("content")
        if not isinstance(content, list) or len(content) != 1:
            raise bad(f"{at}.content", "expected exactly one text part")
        part = strict_object(content[0], f"{at}.content[0]", ("type", "text"))
        if not isinstance(part.get("text"), str):
            raise missing(f"{at}.content[0].text")
        kinds = PART_TYPES[message["role"]]
        if part.get("type", kinds[0]) not in kinds:
            raise bad(f"{at}.content[0].type", f"a {message['role']} part is "
                                               f"{' or '.join(kinds)}")
        optional_str(message.get("id"), f"{at}.id")
        if message.get("status") not in (None, "incomplete", "completed"):
            raise bad(f"{at}.status", "expected 'incomplete' or 'completed'")
        if message.get("type") not in (None, "message"):
            raise bad(f"{at}.type", "expected 'message'")
    return tuple(value)


def parse_audio(value: Any, where: str = "session.audio") -> tuple[AudioFormat, Any]:
    if value is None:
        return AudioFormat(), DEFAULT_VOICE
    audio = strict_object(value, where, AUDIO_FIELDS)
    fmt = AudioFormat() if audio.get("format") is None else parse_format(audio["format"],
                                                                         f"{where}.format")
    output = strict_object(audio.get("output") or {}, f"{where}.output", ("voice",))
    voice = output.get("voice", DEFAULT_VOICE)
    if voice is None:
        voice = DEFAULT_VOICE
    if isinstance(voice, dict):
        if not isinstance(strict_object(voice, f"{where}.output.voice", ("id",)).get("id"),
                          str):
            raise missing(f"{where}.output.voice.id")
    elif not isinstance(voice, str):
        raise bad(f"{where}.output.voice", "expected a voice name or {\"id\": ...}")
    return fmt, voice


def media_session(value: Any) -> dict[str, Any]:
    """A WebRTC session's configuration (``MediaSessionConfig``) as its ``session.start``:
    checked (no ``audio.format``: the media transport negotiates it), the fields of a
    media session alone dropped (a speech wake policy pauses nothing here: the model
    always listens)."""
    session = strict_object(value, "session", SESSION_FIELDS + MEDIA_FIELDS)
    if isinstance(session.get("audio"), dict) and "format" in session["audio"]:
        raise unknown("session.audio.format")
    whole_ms(session.get("idle_timeout_s"), "session.idle_timeout_s")
    if session.get("wake_policy") is not None:
        strict_object(session["wake_policy"], "session.wake_policy", ("type", "vad_threshold"))
    start = {k: v for k, v in session.items() if k not in MEDIA_FIELDS}
    parse_start(start)
    return start


def parse_start(value: Any) -> LiveConfig:
    """``session.start``'s ``session``, strictly."""
    if value is None:
        raise missing("session")
    session = strict_object(value, "session", SESSION_FIELDS)
    if not isinstance(session.get("model"), str) or not session["model"]:
        raise missing("session.model")
    fmt, voice = parse_audio(session.get("audio"))
    if session.get("store"):
        raise bad("session.store", "this server stores no session (no forks, no recording)")
    if session.get("store") is not None and not isinstance(session["store"], bool):
        raise bad("session.store", "expected a boolean")
    parse_triggers(session.get("triggers"), "session.triggers")
    if session.get("client") is not None:
        raise bad("session.client", "data channel permissions for an untrusted frontend are "
                                    "not enforced here; mint an ephemeral key for it instead")
    return LiveConfig(
        model=session["model"],
        instructions=optional_str(session.get("instructions"), "session.instructions"),
        format=fmt, voice=voice, input=parse_input(session.get("input")),
        delegation=parse_delegation(session.get("delegation"), "session.delegation"),
        safety_identifier=optional_str(session.get("safety_identifier"),
                                       "session.safety_identifier"))


def parse_update(config: LiveConfig, value: Any) -> LiveConfig:
    """``session.update``'s ``session`` merged into ``config``."""
    if value is None:
        raise missing("session")
    session = strict_object(value, "session", UPDATE_FIELDS)
    parse_triggers(session.get("triggers"), "session.triggers")
    if "delegation" not in session:
        return config
    return replace(config, delegation=parse_delegation(session["delegation"],
                                                       "session.delegation",
                                                       config.delegation))


def system_prompt(config: LiveConfig, appended: tuple[str, ...] = ()) -> str | None:
    """The model's prompt: the instructions, the text history, and context appended
    before the model heard audio."""
    lines = [config.instructions] if config.instructions else []
    for message in config.input:
        lines.append(f"{message['role']}: {message['content'][0]['text']}")
    lines.extend(appended)
    return "\n".join(lines) or None
