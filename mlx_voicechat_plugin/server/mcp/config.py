"""The operator's MCP servers: the ``mcpServers`` file of Claude Desktop, Cursor and VS Code.

``{"mcpServers": {"NAME": {"command", "args", "env"} | {"url", "headers"}}}``: a stdio
server is a child process (``command`` with ``args``, ``env`` over the server's
environment, optional ``cwd``); a streamable HTTP server is a ``url`` with optional
``headers``. Keys of ours, all optional: ``timeout`` (seconds a call may take,
default :data:`~...runtime.tool_failures.DEFAULT_TOOL_TIMEOUT`), ``toolTimeouts``
(``{"TOOL": seconds}``, a tool's own) and ``ackMessages``
(what the model may say while the call runs). ``disabled: true`` skips a server.
Every mistake is one :class:`McpConfigError` naming the server and the field.
``env`` and ``headers`` are secrets: their values appear in no ``repr``, log or event.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from ...runtime.tool_failures import DEFAULT_TOOL_TIMEOUT

logger = logging.getLogger(__name__)

_SERVER_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_KNOWN = frozenset({"type", "command", "args", "env", "cwd", "url", "headers", "timeout",
                    "toolTimeouts", "ackMessages", "disabled", "transport"})
DEFAULT_ACK = ("One moment.",)


class McpConfigError(ValueError):
    """The ``--mcp`` file is not a usable ``mcpServers`` configuration."""


def _secret(values: Mapping[str, str]) -> str:
    """A secret mapping as its keys only."""
    return "{" + ", ".join(f"{k!r}: '***'" for k in sorted(values)) + "}"


@dataclass(frozen=True)
class McpServerSpec:
    """One server of the file: stdio (``command``) or streamable HTTP (``url``)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    timeout: float = DEFAULT_TOOL_TIMEOUT
    tool_timeouts: Mapping[str, float] = field(default_factory=dict)
    ack_messages: tuple[str, ...] = DEFAULT_ACK

    @property
    def kind(self) -> str:
        return "stdio" if self.command is not None else "http"

    def describe(self) -> str:
        """What a log may say of it: no ``env`` or ``headers`` value, no URL credentials."""
        if self.command is not None:
            return f"{self.name} (stdio: {self.command}, env {_secret(self.env)})"
        parts = urlsplit(self.url or "")
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{self.name} (http: {parts.scheme}://{host}{port}{parts.path}, " \
               f"headers {_secret(self.headers)})"


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise McpConfigError(f"{where} must be a list of strings")
    return tuple(value)


def _mapping(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise McpConfigError(f"{where} must be an object of string values")
    return dict(value)


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
        raise McpConfigError(f"{where} must be seconds in (0, 3600], got {value!r}")
    return float(value)


def parse_server(name: str, spec: Any) -> McpServerSpec | None:
    """One entry of ``mcpServers`` (``None``: ``disabled``)."""
    where = f"mcpServers.{name}"
    if not _SERVER_NAME.fullmatch(name):
        raise McpConfigError(f"{where}: a server name must match {_SERVER_NAME.pattern}")
    if not isinstance(spec, dict):
        raise McpConfigError(f"{where} must be an object, got {type(spec).__name__}")
    if spec.get("disabled") is True:
        return None
    for key in sorted(set(spec) - _KNOWN):
        logger.warning("%s.%s is not used (known keys: %s)", where, key, ", ".join(sorted(_KNOWN)))
    kind = spec.get("type", spec.get("transport"))
    if kind in ("sse",):
        raise McpConfigError(f"{where}.type 'sse' is not supported; use a streamable HTTP url")
    timeout = _seconds(spec.get("timeout", DEFAULT_TOOL_TIMEOUT), f"{where}.timeout")
    per_tool = spec.get("toolTimeouts", {})
    if not isinstance(per_tool, dict):
        raise McpConfigError(f"{where}.toolTimeouts must be an object of seconds by tool name")
    tool_timeouts = {str(k): _seconds(v, f"{where}.toolTimeouts.{k}") for k, v in per_tool.items()}
    acks = _strings(spec.get("ackMessages", list(DEFAULT_ACK)), f"{where}.ackMessages")
    if not all(a.isascii() for a in acks):
        raise McpConfigError(f"{where}.ackMessages must be ASCII")
    common = {"name": name, "timeout": timeout, "tool_timeouts": tool_timeouts,
              "ack_messages": acks}
    if ("command" in spec) == ("url" in spec):
        raise McpConfigError(f"{where} needs exactly one of 'command' (stdio) or 'url' (HTTP)")
    if "command" in spec:
        command = spec["command"]
        if not isinstance(command, str) or not command:
            raise McpConfigError(f"{where}.command must be a non-empty string")
        cwd = spec.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise McpConfigError(f"{where}.cwd must be a string")
        return McpServerSpec(command=command, args=_strings(spec.get("args", []), f"{where}.args"),
                             env=_mapping(spec.get("env", {}), f"{where}.env"), cwd=cwd, **common)
    url = spec["url"]
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise McpConfigError(f"{where}.url must be an http(s) URL")
    return McpServerSpec(url=url, headers=_mapping(spec.get("headers", {}), f"{where}.headers"),
                         **common)


def parse_config(payload: Any) -> list[McpServerSpec]:
    """The servers of a decoded ``mcpServers`` file, in its order."""
    if not isinstance(payload, dict) or not isinstance(payload.get("mcpServers"), dict):
        raise McpConfigError("the MCP config must be an object with an 'mcpServers' object")
    servers = [parse_server(name, spec) for name, spec in payload["mcpServers"].items()]
    return [s for s in servers if s is not None]


def load_config(path: str | Path) -> list[McpServerSpec]:
    """The servers of the ``mcpServers`` file at ``path``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise McpConfigError(f"cannot read the MCP config {path}: {exc.strerror}") from None
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise McpConfigError(f"the MCP config {path} is not JSON: {exc}") from None
    return parse_config(payload)
