"""Connection limits below the application: caps on open sockets and a header deadline.

A slow-header client (slowloris) never completes its HTTP request, so the
application never sees it and the API key never applies. These limits act on
the socket: each connection is counted from ``connection_made`` until
``connection_lost`` (whether it stays HTTP or becomes a WebSocket), a new one
beyond ``max_connections`` in all or ``max_connections_per_client`` from one
address is closed at once, and one whose first request's headers have not
arrived within ``header_timeout`` seconds is closed. A WebSocket whose unsent
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
import logging
import socket
import struct
import threading
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


class ConnectionGuard:
    def __init__(self, max_connections: int, max_per_client: int, header_timeout: float,
                 max_unsent_bytes: int = MAX_UNSENT_BYTES,
                 close_grace: float = CLOSE_GRACE_SECONDS):
        self.max_connections = max_connections
        self.close_grace = close_grace
        self.max_per_client = max_per_client
        self.header_timeout = header_timeout
        self.max_unsent_bytes = max_unsent_bytes
        self.peak_unsent_bytes = 0  # the largest write buffer seen on a WebSocket
        self.open: dict[int, str] = {}  # id(transport) -> client address
        self.per_client: Counter[str] = Counter()
        self.refused = 0
        self._lock = threading.Lock()

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "unknown"
        with self._lock:
            if len(self.open) >= self.max_connections:
                why = f"{len(self.open)} connections open (--max-connections)"
            elif self.per_client[address] >= self.max_per_client:
                why = f"{self.per_client[address]} connections from it (--max-connections-per-client)"
            else:
                self.open[id(transport)] = address
                self.per_client[address] += 1
                return True
            self.refused += 1
        logger.warning("refused a connection from %s: %s", address, why)
        return False

    def release(self, transport: asyncio.BaseTransport) -> None:
        with self._lock:
            address = self.open.pop(id(transport), None)
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
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._guard_timer = None
            if not guard.admit(transport):
                transport.close()
                return
            loop = asyncio.get_running_loop()
            self._guard_timer = loop.call_later(guard.header_timeout, self._headers_late)

        def _headers_late(self) -> None:
            logger.warning("closed a connection from %s: no complete request headers in %g s "
                           "(--header-timeout)", getattr(self, "client", None),
                           guard.header_timeout)
            self.transport.close()

        def _headers_arrived(self) -> None:
            if self._guard_timer is not None:
                self._guard_timer.cancel()
                self._guard_timer = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if getattr(self, "cycle", None) is not None:
                self._headers_arrived()

        def handle_websocket_upgrade(self, *args: Any) -> None:
            self._headers_arrived()
            super().handle_websocket_upgrade(*args)

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_arrived()
            guard.release(self.transport)
            super().connection_lost(exc)

    class GuardedWS(ws_base):  # type: ignore[misc, valid-type]
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
            guard.release(self.transport)
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
