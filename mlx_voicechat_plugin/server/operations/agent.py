"""The capacity agent: HAProxy's agent-check answered over TCP (``--agent-port``).

HAProxy connects every ``agent-inter``, may send an ``agent-send`` string,
and reads one line (:func:`~.replica.agent_line`); the agent writes the
line at once, from the live engine, and closes once the prober has read it. It runs on the server's
event loop, so it answers while the engine thread is busy, and stops with
the server: a replica that is gone does not answer, which HAProxy does not
count as a failure (its health check on ``/health`` finds it down).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

logger = logging.getLogger(__name__)

WRITE_TIMEOUT = 2.0  # seconds a prober may take to read the line
MAX_INPUT_BYTES = 4096  # of a prober's input read (and dropped) before closing


class CapacityAgent:
    """A TCP listener answering each connection with ``line()``."""

    def __init__(self, line: Callable[[], str], host: str, port: int):
        self.line, self.host, self.port = line, host, port
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._answer, self.host, self.port)
        bound = self.server.sockets[0].getsockname()
        self.port = bound[1]  # the port chosen when 0 was asked
        logger.info("capacity agent (HAProxy agent-check) on %s:%d", bound[0], bound[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(self.line().encode("ascii", "replace"))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
            # Half-close and read what the prober sent (an ``agent-send``
            # string) until it hangs up: closing with unread input would
            # reset the connection, and the line with it.
            writer.write_eof()
            await asyncio.wait_for(_discard(reader), WRITE_TIMEOUT)
        except Exception as exc:  # a prober that left: nothing to report to
            logger.debug("agent-check answer not delivered: %s", exc)
        finally:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), WRITE_TIMEOUT)
            except Exception:
                pass


async def _discard(reader: asyncio.StreamReader) -> None:
    """Read until the prober hangs up (or sent more than anyone should)."""
    taken = 0
    while taken < MAX_INPUT_BYTES:
        chunk = await reader.read(MAX_INPUT_BYTES)
        if not chunk:
            return
        taken += len(chunk)
