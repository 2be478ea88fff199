"""MCP servers a session names itself (GA's ``{"type": "mcp"}`` tool), and who may reach what.

A session may name an MCP server by URL only where the operator allows it:
``--mcp-allow-url PATTERN`` (``fnmatch`` patterns over the whole URL, e.g.
``https://mcp.example.com/*``; none by default, so none is reached). A URL that
matches no pattern is refused; so is one whose host is (or resolves to) a loopback,
private, link-local or otherwise non-global address, unless a pattern names that
host literally (no wildcard in its host part). ``headers`` are secrets: never
logged, never echoed.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

from ...runtime.tool_failures import DEFAULT_TOOL_TIMEOUT

APPROVALS = ("always", "never")


class UrlRefused(ValueError):
    """A session-supplied MCP server URL the operator did not allow."""


@dataclass(frozen=True)
class SessionMcpServer:
    """One ``{"type": "mcp"}`` tool of a session."""

    label: str
    url: str
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    allowed_tools: tuple[str, ...] | None = None  # None: every tool it lists
    approval: str = "always"  # "always" | "never": the default for its tools
    always: frozenset[str] = frozenset()  # tools that always need approval
    never: frozenset[str] = frozenset()  # tools that never do
    timeout: float = DEFAULT_TOOL_TIMEOUT

    def needs_approval(self, tool: str) -> bool:
        if tool in self.always:
            return True
        if tool in self.never:
            return False
        return self.approval == "always"


def _host_of(pattern: str) -> str:
    return urlsplit(pattern).hostname or ""


class UrlPolicy:
    """The operator's ``--mcp-allow-url`` patterns."""

    def __init__(self, patterns: Sequence[str] = ()):
        self.patterns = tuple(patterns)

    def __bool__(self) -> bool:
        return bool(self.patterns)

    async def check(self, url: str) -> None:
        """``url`` may be connected, else :class:`UrlRefused` (why, without secrets)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UrlRefused("server_url must be an http(s) URL")
        if parts.username or parts.password:
            raise UrlRefused("server_url may not carry credentials (use headers)")
        bare = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        matched = [p for p in self.patterns if fnmatch.fnmatchcase(bare, p)]
        if not matched:
            raise UrlRefused(f"server_url {parts.scheme}://{parts.hostname}{parts.path} is not "
                             "allowed by the operator (--mcp-allow-url)")
        literal = any(_host_of(p) == parts.hostname.lower() and not any(
            c in _host_of(p) for c in "*?[") for p in matched)
        if literal:
            return
        for address in await _addresses(parts.hostname):
            if not address.is_global:
                raise UrlRefused(f"server_url's host {parts.hostname} is a loopback, private "
                                 "or link-local address; only a pattern naming that host "
                                 "allows it")


async def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None,
                                                             type=socket.SOCK_STREAM)
    except OSError as exc:
        raise UrlRefused(f"server_url's host {host} does not resolve ({exc})") from None
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
