"""Graceful stop: a replica that drains on SIGTERM, and the uvicorn server that sends it
(event loop).

:class:`Drain` is the replica's stop, one state at a time::

    serving --begin()--> draining --sessions done, or --drain-seconds--> closing --> stopped
                            \\--stop_now() (a second SIGTERM)----------/

While draining, the engine admits no one (new connections get
``server_busy`` and close 1013; new transcriptions a 503), the agent-check
says ``drain`` and ``/health`` answers 503 (:mod:`.replica`), so a balancer
or a readiness probe sends new sessions elsewhere; open sessions and file
transcriptions run on, and detached ones (awaiting a resume) are ended. When
the last one ends, or ``--drain-seconds`` after the start, the sessions still
open are closed with 1001 and a reason naming the stop, and ``on_drained``
runs (the server exits, with status 0).

The app runs each connection through :meth:`Drain.serve`, which tracks it so
the stop can end it. :func:`draining_server` is uvicorn's server with the
first SIGTERM turned into :meth:`Drain.begin` and a second one into
:meth:`Drain.stop_now`; SIGINT (Ctrl-C) keeps uvicorn's meaning.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any, Callable

from ..messages import Ending

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_SECONDS = 30.0
POLL_SECONDS = 0.05  # how often a drain looks at what is still open
CLOSE_SECONDS = 2.0  # longest the close of the sessions left at the end may take

SERVING, DRAINING, CLOSING, STOPPED = "serving", "draining", "closing", "stopped"


class Drain:
    """The replica's graceful stop (one per app; its loop methods run on the server's loop)."""

    def __init__(self, engine: Any, seconds: float = DEFAULT_DRAIN_SECONDS,
                 on_drained: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, resumes: Any = None):
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not seconds >= 0:
            raise ValueError(f"drain_seconds must be >= 0, got {seconds!r}")
        self.engine, self.seconds, self.on_drained, self.clock = engine, float(seconds), \
            on_drained, clock
        self.state = SERVING
        self.deadline: float | None = None
        self.reason = ""  # the close reason of the sessions ended by the stop
        self.loop: asyncio.AbstractEventLoop | None = None  # set by attach()
        self.open: dict[asyncio.Task, Any] = {}  # connection task -> its Connection
        self.ended: set[asyncio.Task] = set()  # tasks the stop cancelled
        self._runner: asyncio.Task | None = None
        self.resumes = resumes  # the detached sessions (:mod:`..session.resume`), ended at the start

    @property
    def draining(self) -> bool:
        return self.state != SERVING

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The server's loop (at start-up): signal handlers schedule the stop on it."""
        self.loop = loop

    # --- the state machine --------------------------------------------------------

    def begin(self) -> bool:
        """Stop admitting and start draining (on the loop); ``False`` if already stopping."""
        if self.state != SERVING:
            return False
        self.state = DRAINING
        self.engine.admission.draining = True
        self.deadline = self.clock() + self.seconds
        self.reason = f"server shutting down: still open after --drain-seconds {self.seconds:g}"
        logger.info("draining: %d sessions open, %d transcriptions in flight; new sessions "
                    "refused; stopping within %g s", len(self.open),
                    self._transcriptions(), self.seconds)
        if self.resumes is not None:  # nobody may resume them now: their state is freed
            asyncio.ensure_future(self.resumes.end_all("the server is draining"))
        self._runner = asyncio.ensure_future(self._run())
        return True

    def stop_now(self) -> None:
        """End the open sessions at once (a second SIGTERM); begins the drain if need be."""
        if self.state == SERVING:
            self.begin()
        if self.state == DRAINING:
            self.deadline = self.clock()
            self.reason = "server shutting down at once (second SIGTERM)"
            logger.info("stopping at once: closing %d sessions", len(self.open))

    def _idle(self) -> bool:
        return not self.open and not self._transcriptions()

    def _transcriptions(self) -> int:
        counter = getattr(self.engine, "transcriptions", None)
        return counter.in_flight if counter is not None else 0

    async def _run(self) -> None:
        while not self._idle() and self.clock() < self.deadline:
            await asyncio.sleep(POLL_SECONDS)
        self.state = CLOSING
        if self.open:
            logger.info("closing %d sessions still open (1001: %s)", len(self.open),
                        self.reason)
            for task in list(self.open):
                self.ended.add(task)
                task.cancel()
            end = self.clock() + CLOSE_SECONDS
            while self.open and self.clock() < end:
                await asyncio.sleep(POLL_SECONDS / 5)
        self.state = STOPPED
        logger.info("drained")
        if self.on_drained is not None:
            self.on_drained()

    # --- connections ------------------------------------------------------------------

    async def serve(self, connection: Any) -> None:
        """Run ``connection`` (its errors propagate); closed with 1001 if the stop ends it."""
        task = asyncio.ensure_future(connection.run())
        self.open[task] = connection
        try:
            await task
        except asyncio.CancelledError:
            if task not in self.ended:
                raise  # the server is cancelling us: not the drain's doing
            await asyncio.wait_for(connection.close(Ending.STOPPING, self.reason),
                                   CLOSE_SECONDS)
        finally:
            self.open.pop(task, None)
            self.ended.discard(task)


def draining_server(config: Any, drain: Drain) -> Any:
    """uvicorn's server for ``config`` whose SIGTERM drains ``drain`` (see the module doc)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        terms = 0  # SIGTERMs received

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig != signal.SIGTERM:
                super().handle_exit(sig, frame)
                return
            # Not recorded for uvicorn to raise again at exit: a drained replica exits 0.
            self.terms += 1
            loop = drain.loop
            if loop is None or not self.started:  # still starting: nothing to drain
                self.should_exit = True
            elif self.terms == 1:
                logger.info("SIGTERM: draining (a second SIGTERM stops at once)")
                loop.call_soon_threadsafe(drain.begin)
            else:
                logger.info("second SIGTERM: stopping at once")
                self.force_exit = True  # uvicorn waits for nothing once the sessions are closed
                loop.call_soon_threadsafe(drain.stop_now)

    server = DrainingServer(config)
    drain.on_drained = lambda: setattr(server, "should_exit", True)
    return server


def run_server(app: Any, sockets: list[Any] | None = None,
               on_ready: Callable[[], None] | None = None, **options: Any) -> int:
    """``uvicorn.run(app, **options)`` with the app's drain on SIGTERM, on ``sockets``
    when given (bound before the model loads); the exit status.

    ``on_ready`` runs once the model is loaded (and warmed up); a model that fails
    to load stops the server at once, status 1 (the engine has logged why)."""
    import threading

    import uvicorn

    from .redaction import redact_uvicorn_logs

    # Past the drain, requests still open (an upload stalled mid-body) are cancelled
    # within CLOSE_SECONDS instead of holding the process.
    options.setdefault("timeout_graceful_shutdown", CLOSE_SECONDS)
    redact_uvicorn_logs()  # no key or resume token in the access log
    config = uvicorn.Config(app, **options)
    server = draining_server(config, app.state.drain)
    engine = app.state.engine

    def watch() -> None:
        engine.loaded.wait()
        if engine.load_error is not None:
            server.should_exit = True
        elif on_ready is not None:
            on_ready()

    threading.Thread(target=watch, name="mlx-voicechat-ready", daemon=True).start()
    server.run(sockets=sockets)
    # A forced stop skips the app's shutdown: stop the engine here too, so its
    # thread ends (and frees its MLX streams) before the interpreter exits.
    engine.stop()
    return 1 if engine.load_error is not None else 0
