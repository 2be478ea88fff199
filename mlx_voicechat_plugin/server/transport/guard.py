"""Connection limits below the application: caps on open sockets and a deadline on every phase.

A slow-header client (slowloris) never completes its HTTP request, so the
application never sees it and the API key never applies. These limits act on
the socket: each connection is counted from ``connection_made`` until
``connection_lost`` (whether it stays HTTP or becomes a WebSocket), and each
phase of it has a deadline:

- a request's headers (every request's, on a kept-alive connection too, the
  idle wait for the next one included) must arrive within ``header_timeout``
  seconds of the connection's start or of the previous response's end;
- a request's body within ``body_timeout`` seconds of its headers (a 408 when
  no response has started);
- a WebSocket's opening handshake within ``header_timeout`` of the upgrade.

A connection past its deadline is closed. A new one beyond
``max_connections_per_client`` from one address (IPv6 addresses grouped by
their /64, what one host is given) is closed at once. When ``max_connections``
are open, the newcomer takes the place of the longest-waiting connection that
holds no request (it waits for headers or sits idle between requests), taken
from the address group holding the most: a flood of idle or slow-header
sockets cannot keep ``/health`` or an authenticated upgrade out; only when
every connection is busy is the newcomer closed. A WebSocket whose unsent
bytes pass ``max_unsent_bytes`` (pongs to a ping flood from a client that
never reads) is closed. A keepalive pong is not missed while the server has
paused reading (a client sending faster than the engine takes its audio). Once
the application is done with a WebSocket, its
socket is aborted if it is still open ``close_grace`` seconds later: a close
handshake (and the flush before it) waits on a client that never reads for
ever otherwise. Each refusal is logged.

:func:`uvicorn_protocols` returns the ``http`` / ``ws`` protocol classes to
hand to ``uvicorn.run`` / ``uvicorn.Config``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
import threading
import time
from collections import Counter
from typing import Any

logger = logging.getLogger(__name__)


# A WebSocket whose unsent bytes pass this is closed: application sends wait
# for the transport (its high-water mark is 64 KiB), so only the WebSocket
# layer's own replies (a pong for every ping) can pile up this far.
MAX_UNSENT_BYTES = 4 * 2**20
# Seconds a WebSocket's close handshake may take once the application is done
# with it; then the socket is aborted.
CLOSE_GRACE_SECONDS = 2.0
DEFAULT_BODY_TIMEOUT = 120.0  # a request body's deadline after its headers
IPV6_GROUP_BITS = 64  # IPv6 addresses counted together: one host's prefix

# The phases of an HTTP connection the deadlines follow.
WAITING, BODY, BUSY = "waiting for a request", "reading a body", "serving"

REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                   b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


def address_group(peer: Any) -> str:
    """The address a connection is counted under: its IPv4 address, or its IPv6 /64."""
    host = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "unknown"
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_GROUP_BITS), strict=False))
    return str(address)


class ConnectionGuard:
    def __init__(self, max_connections: int, max_per_client: int, header_timeout: float,
                 max_unsent_bytes: int = MAX_UNSENT_BYTES,
                 close_grace: float = CLOSE_GRACE_SECONDS,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT):
        self.max_connections = max_connections
        self.close_grace = close_grace
        self.max_per_client = max_per_client
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_unsent_bytes = max_unsent_bytes
        self.peak_unsent_bytes = 0  # the largest write buffer seen on a WebSocket
        self.open: dict[int, str] = {}  # id(transport) -> client address group
        self.protocols: dict[int, Any] = {}  # id(transport) -> its HTTP protocol
        self.per_client: Counter[str] = Counter()
        self.refused = 0
        self.evicted = 0
        self._lock = threading.Lock()

    def admit(self, transport: asyncio.BaseTransport, protocol: Any = None) -> bool:
        address = address_group(transport.get_extra_info("peername"))
        evict = None
        with self._lock:
            if self.per_client[address] >= self.max_per_client:
                why = (f"{self.per_client[address]} connections from it "
                       "(--max-connections-per-client)")
            elif len(self.open) >= self.max_connections and (evict := self._idlest()) is None:
                why = f"{len(self.open)} connections open, none idle (--max-connections)"
            else:
                if evict is not None:  # counted no more from now: its close comes later
                    self._forget(id(evict[0].transport))
                self.open[id(transport)] = address
                self.per_client[address] += 1
                if protocol is not None:
                    self.protocols[id(transport)] = protocol
                why = ""
            if why:
                self.refused += 1
        if evict is not None:
            self.evicted += 1
            logger.warning("closed an idle connection from %s to admit one from %s "
                           "(--max-connections)", evict[1], address)
            evict[0].transport.close()
        if why:
            logger.warning("refused a connection from %s: %s", address, why)
        return not why

    def _idlest(self) -> tuple[Any, str] | None:
        """The connection a newcomer replaces when all are open: holding no request, from
        the address group with the most, waiting longest (lock held)."""
        idle = [(ident, p) for ident, p in self.protocols.items() if p.guard_phase == WAITING]
        if not idle:
            return None
        ident, protocol = min(idle, key=lambda item: (-self.per_client[self.open[item[0]]],
                                                      item[1].guard_since))
        return protocol, self.open[ident]

    def lost(self, transport: asyncio.BaseTransport) -> None:
        """``transport``'s connection ended: counted no more."""
        with self._lock:
            self._forget(id(transport))

    def _forget(self, ident: int) -> None:
        self.protocols.pop(ident, None)
        address = self.open.pop(ident, None)
        if address is not None:
            self.per_client[address] -= 1
            if not self.per_client[address]:
                del self.per_client[address]


def reset(transport: asyncio.BaseTransport) -> None:
    """Abort with a TCP reset: a plain close leaves the kernel sending what a client that
    never reads will never take (its window stays shut), the connection open for minutes."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


def uvicorn_protocols(guard: ConnectionGuard) -> dict[str, Any]:
    """``{"http": cls, "ws": cls}``: uvicorn's own protocols with the guard applied."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    # The classes uvicorn's "auto" would pick, so only the guard differs.
    http_base, ws_base = AutoHTTPProtocol, AutoWebSocketsProtocol

    class GuardedHTTP(http_base):  # type: ignore[misc, valid-type]
        guard_phase, guard_since = BUSY, 0.0
        _guard_timer: asyncio.TimerHandle | None = None
        _guard_upgraded = False  # a WebSocket now: its protocol keeps the deadlines

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if not guard.admit(transport, self):
                transport.close()
                return
            self._guard_follow()

        def _guard_now(self) -> str:
            """The connection's phase, read from uvicorn's request cycle."""
            cycle = getattr(self, "cycle", None)
            if cycle is None or cycle.response_complete:
                return WAITING
            return BODY if cycle.more_body and not cycle.response_started else BUSY

        def _guard_follow(self) -> None:
            """Arm the deadline of the phase the connection is in, once per phase."""
            phase = self._guard_now()
            if self._guard_upgraded or self.transport.is_closing() or phase == self.guard_phase:
                return
            self._guard_cancel()
            self.guard_phase, self.guard_since = phase, time.monotonic()
            seconds = {WAITING: guard.header_timeout, BODY: guard.body_timeout}.get(phase)
            if seconds is not None:
                self._guard_timer = asyncio.get_running_loop().call_later(
                    seconds, self._guard_late, phase)

        def _guard_cancel(self) -> None:
            if self._guard_timer is not None:
                self._guard_timer.cancel()
                self._guard_timer = None

        def _guard_late(self, phase: str) -> None:
            self._guard_timer = None
            if phase == WAITING:
                logger.warning("closed a connection from %s: no complete request headers in "
                               "%g s (--header-timeout)", getattr(self, "client", None),
                               guard.header_timeout)
            else:
                logger.warning("closed a connection from %s: the request body did not arrive "
                               "in %g s (--body-timeout)", getattr(self, "client", None),
                               guard.body_timeout)
                cycle = getattr(self, "cycle", None)
                if cycle is not None and not cycle.response_started:
                    message = f"request body not received in {guard.body_timeout:g} s " \
                              "(--body-timeout)"
                    self.transport.write(REQUEST_TIMEOUT % (len(message), message.encode()))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._guard_follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._guard_follow()

        def shutdown(self) -> None:
            """The server stops (past the drain): a body still arriving is never served."""
            if self.guard_phase == BODY:
                self.transport.close()
            super().shutdown()

        def handle_websocket_upgrade(self, *args: Any) -> None:
            self._guard_cancel()
            self.guard_phase, self._guard_upgraded = BUSY, True
            super().handle_websocket_upgrade(*args)

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard_cancel()
            guard.lost(self.transport)
            super().connection_lost(exc)

    class GuardedWS(ws_base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._guard_timer = asyncio.get_running_loop().call_later(
                guard.header_timeout, self._handshake_late)

        def _handshake_late(self) -> None:
            if not getattr(self, "handshake_complete", True) and \
                    getattr(self, "initial_response", None) is None:
                logger.warning("closed a WebSocket from %s: no handshake in %g s "
                               "(--header-timeout)", getattr(self, "client", None),
                               guard.header_timeout)
                self.transport.abort()

        def data_received(self, data: bytes) -> None:  # type: ignore[override]
            super().data_received(data)
            unsent = self.transport.get_write_buffer_size()
            guard.peak_unsent_bytes = max(guard.peak_unsent_bytes, unsent)
            if unsent > guard.max_unsent_bytes:
                # A ping flood from a client that never reads its pongs.
                logger.warning("closed a WebSocket from %s: %d bytes unsent, the client is "
                               "not reading", getattr(self, "client", None), unsent)
                reset(self.transport)

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard_timer.cancel()
            guard.lost(self.transport)
            super().connection_lost(exc)

        def keepalive_timeout(self) -> None:
            """No pong yet while this server has paused reading (the application is behind
            on what the client sent): the pong waits in the unread bytes, so wait again."""
            if getattr(self, "read_paused", False) and not self.close_sent:
                self.pong_timer = self.loop.call_later(self.ping_timeout, self.keepalive_timeout)
                return
            super().keepalive_timeout()

        async def run_asgi(self) -> None:
            """The application's life, then a bounded close: abort the socket if the
            client has not completed the close ``close_grace`` seconds later."""
            try:
                await super().run_asgi()
            finally:
                self.loop.call_later(guard.close_grace, self._abort_if_open)

        def _abort_if_open(self) -> None:
            if not self.transport.is_closing() or self.transport.get_write_buffer_size():
                logger.info("aborted a WebSocket from %s: its close did not complete in %g s",
                            getattr(self, "client", None), guard.close_grace)
                reset(self.transport)

        async def receive(self) -> Any:  # uvicorn's websockets-sansio protocol
            """A connection lost with no close frame is 1006, abnormal closure (uvicorn's
            websockets protocols say 1005, as for a close frame with no code): a session
            whose link dropped may wait to be resumed; one the client closed may not."""
            message = await super().receive()
            if message.get("type") == "websocket.disconnect" and message.get("code") == 1005 \
                    and getattr(getattr(self, "conn", self), "close_rcvd", False) is None:
                message = {**message, "code": 1006}
            return message

    GuardedHTTP.guard = GuardedWS.guard = guard  # type: ignore[attr-defined]
    return {"http": GuardedHTTP, "ws": GuardedWS}
