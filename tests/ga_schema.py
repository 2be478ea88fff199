"""The OpenAI Realtime GA server events as the openai package types them.

:func:`check` validates one server event, as it went out on the wire, against the
installed openai package's ``RealtimeServerEvent`` union (a ``TypeAdapter`` over it,
discriminated on ``type``: the check the Agents SDK's GA WebSocket model makes on every
event it reads, here in pydantic's strict mode). Our own events with no type in the
union (:data:`EXTENSIONS`, each described in docs/protocol.md) are checked against
their own shape. :func:`emitted_types` reads, from the GA dialect's source, every
event type it can send.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import typing
from types import ModuleType
from typing import Annotated, Any, Literal

from openai.types.realtime.realtime_client_event import RealtimeClientEvent
from openai.types.realtime.realtime_server_event import RealtimeServerEvent
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from mlx_voicechat_plugin.server.dialects.ga.dialect import FIELDS, GADialect

SERVER_EVENT = TypeAdapter(Annotated[RealtimeServerEvent, Field(discriminator="type")])
CLIENT_EVENT = TypeAdapter(Annotated[RealtimeClientEvent, Field(discriminator="type")])


def union_types(union: Any) -> set[str]:
    """The ``type`` literals of a union of event models."""
    found: set[str] = set()
    for member in typing.get_args(union):
        if typing.get_origin(member) is Annotated:
            member = typing.get_args(member)[0]
        if isinstance(member, type) and issubclass(member, BaseModel):
            found.update(typing.get_args(member.model_fields["type"].annotation))
        else:
            found |= union_types(member)
    return found


SERVER_TYPES = union_types(RealtimeServerEvent)
CLIENT_TYPES = union_types(RealtimeClientEvent)


class _Resumed(BaseModel):
    """``session.resumed``: sent only to a client that resumed with ``?resume_token=``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    class Session(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        id: str
        resume_token: str

    type: Literal["session.resumed"]
    event_id: str
    session: Session
    last_seq: int
    replayed: int
    audio_received_samples: int
    audio_sample_rate: int


# Our events with no type in the union -> their own model.
EXTENSIONS: dict[str, type[BaseModel]] = {"session.resumed": _Resumed}
# Strings in the dialect's source shaped like an event type that are no server event:
# the client's field names in errors and the GA objects' ``object`` values.
NOT_EVENTS = set(FIELDS.values()) | {"realtime.session", "realtime.item", "realtime.response",
                                     "session.audio.input.turn_detection"}
_EVENT_SHAPE = re.compile(r"^[a-z_]+(\.[a-z_]+)+$")
PACKAGE = "mlx_voicechat_plugin.server.dialects"


def check(event: dict[str, Any], seen: set[str] | None = None,
          union: TypeAdapter = SERVER_EVENT) -> Any:
    """``event`` (as the client read it) validated against ``union`` (GA's server events
    by default) or its extension's model; its type added to ``seen``."""
    kind = event.get("type")
    if kind in EXTENSIONS:
        parsed = EXTENSIONS[kind].model_validate(event)
    else:
        parsed = union.validate_python(event, strict=True)
    if seen is not None:
        seen.add(kind)
    return parsed


def _modules() -> list[ModuleType]:
    """The GA dialect's modules: its own and every module of the dialects package it
    reaches (its base class's included), whatever they are named."""
    found: dict[str, ModuleType] = {}
    todo = [sys.modules[cls.__module__] for cls in GADialect.__mro__
            if cls.__module__.startswith(PACKAGE)]
    while todo:
        module = todo.pop()
        if module.__name__ in found:
            continue
        found[module.__name__] = module
        for value in vars(module).values():
            owner = value if isinstance(value, ModuleType) else inspect.getmodule(value)
            if owner is not None and owner.__name__.startswith(PACKAGE) \
                    and owner.__name__ not in found:
                todo.append(owner)
    return list(found.values())


def emitted_types() -> set[str]:
    """Every event type the GA dialect's source can send: each string constant shaped
    like an event type, less the client's event types and :data:`NOT_EVENTS`; one
    neither in the union nor in :data:`EXTENSIONS` fails (say what it is)."""
    strings: set[str] = set()
    for module in _modules():
        tree = ast.parse(inspect.getsource(module))
        strings |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and (_EVENT_SHAPE.match(node.value) or node.value in SERVER_TYPES)}
    emitted = strings - CLIENT_TYPES - NOT_EVENTS
    unknown = emitted - SERVER_TYPES - set(EXTENSIONS)
    assert not unknown, (f"{sorted(unknown)}: not a GA server event type; add an extension "
                         "to EXTENSIONS (and docs/protocol.md) or the string to NOT_EVENTS")
    return emitted


def every_type_checked(request: Any, emitted: set[str], seen: set[str], dialect: str) -> None:
    """The last test of a schema module: each of ``emitted`` was validated by the module's
    other tests (``seen``); skipped unless the whole module ran."""
    import pytest

    others = [item for item in request.session.items
              if item.module is request.module and item is not request.node]
    if len(others) < len(request.node.parent.collect()) - 1:
        pytest.skip("run with the whole module: its other tests do the checking")
    unchecked = emitted - seen
    assert not unchecked, f"event types the {dialect} dialect sends that no test checked: " \
                          f"{sorted(unchecked)}"
