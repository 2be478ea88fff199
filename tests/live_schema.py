"""The GPT-Live server events as the openai package types them.

:func:`check` validates one server event, as it went out on the wire, strictly against
the installed openai package's ``openai.types.live.ServerEvent`` union (discriminated on
``type``); a ``response.event``'s nested event is validated against the Responses
API's ``ResponseStreamEvent`` union too. Our own events with no type in the union
(:data:`EXTENSIONS`, in docs/protocol.md) are checked against their own shape.
:func:`emitted_types` reads, from the GPT-Live dialect's source, every event type it can
send: each ``"type"`` of a dict literal that is a Live server event, a Responses stream
event, or dotted.
"""

from __future__ import annotations

import ast
import inspect
import sys
from types import ModuleType
from typing import Annotated, Any

import ga_schema
from ga_schema import EXTENSIONS, union_types
from openai.types.live.client_event import ClientEvent
from openai.types.live.server_event import ServerEvent
from openai.types.responses.response_stream_event import ResponseStreamEvent
from pydantic import Field, TypeAdapter

from mlx_voicechat_plugin.server.dialects.live.dialect import LiveDialect

SERVER_EVENT = TypeAdapter(Annotated[ServerEvent, Field(discriminator="type")])
CLIENT_EVENT = TypeAdapter(Annotated[ClientEvent, Field(discriminator="type")])
RESPONSES_EVENT = TypeAdapter(Annotated[ResponseStreamEvent, Field(discriminator="type")])
SERVER_TYPES = union_types(ServerEvent)
CLIENT_TYPES = union_types(ClientEvent)
RESPONSES_TYPES = union_types(ResponseStreamEvent)
PACKAGE = "mlx_voicechat_plugin.server.dialects.live"


def check(event: dict[str, Any], seen: set[str] | None = None) -> Any:
    """``event`` (as the client read it) validated; its type (and a nested Responses
    event's) added to ``seen``."""
    parsed = ga_schema.check(event, seen, SERVER_EVENT)
    if event["type"] == "response.event":
        RESPONSES_EVENT.validate_python(event["event"])
        if seen is not None:
            seen.add(event["event"]["type"])
    return parsed


def _modules() -> list[ModuleType]:
    """The GPT-Live dialect's own modules (its package's)."""
    return [module for name, module in sorted(sys.modules.items())
            if name.startswith(PACKAGE + ".")]


def _strings(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Every string constant, and those a dict literal gives as its ``"type"``."""
    constants = {node.value for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    typed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            typed |= {value.value for key, value in zip(node.keys, node.values)
                      if isinstance(key, ast.Constant) and key.value == "type"
                      and isinstance(value, ast.Constant) and isinstance(value.value, str)}
    return constants, typed


def emitted_types() -> set[str]:
    """Every server event type the GPT-Live dialect's source can send: each string that
    is a Live server event or a Responses stream event type, and each dotted ``"type"``
    of a dict (one neither in the unions nor in :data:`EXTENSIONS` fails: say what it
    is); the client's event types are not sent."""
    assert LiveDialect is not None  # its modules are imported
    constants: set[str] = set()
    typed: set[str] = set()
    for module in _modules():
        found = _strings(ast.parse(inspect.getsource(module)))
        constants |= found[0]
        typed |= {t for t in found[1] if "." in t}
    known = SERVER_TYPES | RESPONSES_TYPES
    unknown = typed - known - CLIENT_TYPES - set(EXTENSIONS)
    assert not unknown, f"{sorted(unknown)}: not a GPT-Live server event type"
    return ((constants & known) | typed) - CLIENT_TYPES
