"""Where a WebRTC call's ICE candidates come from: the host addresses and STUN/TURN servers.

By default aioice (aiortc's ICE agent) gathers a host candidate on every
interface address but loopback, and aiortc asks Google's public STUN server
when given no servers at all. The server does neither unless told:
:class:`ICEConfig` holds ``--ice-host`` (the only addresses candidates are
gathered on; none: every interface, aioice's default) and ``--ice-server``
(STUN/TURN URLs; none: no server is ever asked). Behind NAT, a TURN server
gives clients a relay address they can reach (``docs/webrtc.md``).

:meth:`ICEConfig.gathering` (:func:`gathering_on`) is the context in which a
peer connection sets its local description (which gathers): its host
candidates come from the host addresses only, and no other gathering is
touched. Nothing here imports aiortc until a call is made, so the server
runs without it.
"""

from __future__ import annotations

import ipaddress
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator
from urllib.parse import unquote

ICE_SCHEMES = ("stun:", "stuns:", "turn:", "turns:")
# RFC 7675 consent freshness, as this server checks it: a consent request every
# second or so, and the call is over after 3 unanswered in a row (each waits 0.5 s).
# aioice's defaults (every 5 s, 6 failures) hold a killed browser tab's session
# slot for 30 s and more; these free it within about 5 s.
CONSENT_INTERVAL_SECONDS = 1.0
CONSENT_FAILURES = 3


def quick_consent() -> None:
    """Check a call's consent as :data:`CONSENT_INTERVAL_SECONDS` and
    :data:`CONSENT_FAILURES` say (aioice reads them from its module at each check:
    this process's setting, for every call it serves)."""
    import aioice.ice

    aioice.ice.CONSENT_INTERVAL = CONSENT_INTERVAL_SECONDS
    aioice.ice.CONSENT_FAILURES = CONSENT_FAILURES


@dataclass(frozen=True)
class ICEServer:
    """One STUN or TURN server (TURN with the credentials it needs)."""

    url: str
    username: str | None = None
    credential: str | None = None

    @classmethod
    def parse(cls, value: str) -> "ICEServer":
        """``stun:HOST[:PORT]`` or ``turn[s]:[USER:PASSWORD@]HOST[:PORT][?transport=udp|tcp]``."""
        value = str(value).strip()
        scheme = next((s for s in ICE_SCHEMES if value.lower().startswith(s)), None)
        if scheme is None or len(value) == len(scheme):
            raise ValueError(f"ice_servers: {value[:80]!r} must be a stun:, stuns:, turn: or "
                             "turns: URL with a host")
        rest = value[len(scheme):]
        if "@" not in rest:
            return cls(value)
        credentials, _, address = rest.rpartition("@")
        username, _, credential = credentials.partition(":")
        if not scheme.startswith("turn") or not username or not address:
            raise ValueError("ice_servers: only a turn: URL carries USER:PASSWORD@ before its "
                             "host")
        return cls(scheme + address, unquote(username), unquote(credential))


@dataclass(frozen=True)
class ICEConfig:
    """The server's ICE settings: ``hosts`` gathered on (none: every interface but
    loopback), ``servers`` asked (none: no STUN, no TURN)."""

    hosts: tuple[str, ...] = ()
    servers: tuple[ICEServer, ...] = ()

    def __post_init__(self) -> None:
        for host in self.hosts:
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"ice_hosts: {host[:80]!r} is not an IP address") from None

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "ICEConfig":
        """``{"hosts": [...], "servers": [URL, ...]}`` (a server may be an
        :class:`ICEServer` already)."""
        values = dict(values or {})
        unknown = set(values) - {"hosts", "servers"}
        if unknown:
            raise ValueError(f"unknown ICE settings {sorted(unknown)}; expected hosts, servers")
        servers = tuple(s if isinstance(s, ICEServer) else ICEServer.parse(s)
                        for s in values.get("servers") or ())
        return cls(tuple(str(h).strip() for h in values.get("hosts") or ()), servers)

    def rtc_configuration(self) -> Any:
        """aiortc's ``RTCConfiguration``: these servers only (never aiortc's default STUN)."""
        from aiortc import RTCConfiguration, RTCIceServer

        return RTCConfiguration(iceServers=[
            RTCIceServer(s.url, username=s.username, credential=s.credential)
            for s in self.servers])

    def gathering(self) -> ContextManager[None]:
        """Within it, ICE gathering (``setLocalDescription``) uses :attr:`hosts` only."""
        return gathering_on(self.hosts)


# The host addresses of the gathering in progress, for the context it runs in (None:
# aioice's own choice). aiortc gathers in tasks made while setLocalDescription runs,
# which copy the context, so one call's addresses never reach another's.
_HOSTS: ContextVar[tuple[str, ...] | None] = ContextVar("ice_hosts", default=None)
_AIOICE_HOSTS: list[Callable[[bool, bool], list[str]]] = []  # aioice's own function, once


def _host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    hosts = _HOSTS.get()
    return list(hosts) if hosts is not None else _AIOICE_HOSTS[0](use_ipv4, use_ipv6)


@contextmanager
def gathering_on(hosts: tuple[str, ...]) -> Iterator[None]:
    """ICE host candidates gathered within this context come from ``hosts`` only (none:
    every interface but loopback, aioice's default); STUN/TURN candidates are unchanged.

    aioice's agent takes its host addresses from ``aioice.ice.get_host_addresses()``
    and has no option for them; that function is replaced once by one that answers
    ``hosts`` inside this context and aioice's own answer outside it.
    """
    import aioice.ice

    if aioice.ice.get_host_addresses is not _host_addresses:
        _AIOICE_HOSTS[:] = [aioice.ice.get_host_addresses]
        aioice.ice.get_host_addresses = _host_addresses
    token = _HOSTS.set(tuple(hosts) if hosts else None)
    try:
        yield
    finally:
        _HOSTS.reset(token)
