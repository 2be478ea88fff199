"""The engine thread: the only thread that touches MLX.

Socket tasks queue :mod:`.commands` (open, append, push, sync, flush, cancel,
tool result, close, transcribe; :meth:`Engine.submit` queues one at once)
and await a one-shot reply (an asyncio future the engine resolves via
``loop.call_soon_threadsafe``). A session's events come back already
translated to JSON text, base64 audio included, by the dialect that opened
it (its :class:`~.commands.Translator`), so the event loop only forwards
strings; the engine speaks no dialect itself.

The engine holds up to ``max_sessions`` streaming sessions in a
:class:`~..runtime.pool.SessionPool`; a connection reserves a slot when it
is accepted, so admission beyond ``max_sessions`` (or beyond
``max_state_bytes`` of reserved session state, counting the least a session
reserves for each connection not yet opened) is refused at once, and the
reservation is released on every exit path. Audio does not wait for its
reply: a connection hands PCM to its session's input queue
(:meth:`Engine.append`, through a bounded :class:`~.feed.InputFeed`), and
the engine runs one pool step over the sessions with a frame ready
(:mod:`.stepping`, when :mod:`.scheduler` says so; ``--batch-wait-ms``).
Commit, cancel and tool results queue behind the audio sent before them. A
session is a full conversation or a text-only transcription stream
(perception + RNNT only); both kinds share the pool and its steps.

File transcriptions and session opens are jobs (:mod:`.jobs`), stepped round
robin after every step and whenever nothing else is due: a file one step at
a time (its perception, then 25 RNNT frames), a prefill in slices of
``PREFILL_SLICE_SECONDS``, so neither realtime frames, files nor a new
session starve; the caller bounds the files in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Generator

import numpy as np

from ..runtime.events import Cancelled
from ..runtime.pool import PoolFull, SessionPool, admission_error, check_budgets
from ..runtime.prompt_cache import PromptCache
from ..runtime.options import TranscriptionOptions
from .commands import (
    Append, Cancel, Close, Command, DeltaSink, Flush, Open, OpenOptions, Push, SessionDetails,
    Sync, ToolResult, Transcribe, Translator,
)
from .jobs import JobCounter, JobQueue, StepJob
from .limits import DEFAULT_BATCH_WAIT_MS
from .metrics import EngineMetrics
from .scheduler import BatchScheduler, StepCosts
from .stepping import NOT_ACTIVE, InputStepper, notify
from .warm_up import run_warm_up

logger = logging.getLogger(__name__)

# Longest a new session's prefill runs before the other sessions' frames do.
PREFILL_SLICE_SECONDS = 0.02

Loader = Callable[[str], Any]  # checkpoint path -> VoiceChat


def load_voicechat(path: str) -> Any:
    from .. import load

    model, processor = load(path)
    return model.create_session(processor)


class Engine:
    """One long-lived worker thread owning the model and its streaming sessions."""

    def __init__(self, model_path: str, loader: Loader | None = None,
                 prompt_cache_bytes: int | None = None, warm_up: bool = False,
                 max_sessions: int = 1, max_state_bytes: int | None = None,
                 batch_wait: float = DEFAULT_BATCH_WAIT_MS / 1000, batch_fill: bool = True,
                 session_defaults: Any = None):
        check_budgets(max_sessions, max_state_bytes)
        if isinstance(batch_wait, bool) or not isinstance(batch_wait, (int, float)) \
                or not batch_wait >= 0:
            raise ValueError(f"batch_wait must be >= 0 seconds, got {batch_wait!r}")
        self.batch_wait = float(batch_wait)  # the collection deadline of a step
        self.batch_fill = batch_fill  # stretch it to fill batches once sessions need batching
        self.step_costs = StepCosts()  # measured step seconds by batch size (warm-up and live)
        self.max_sessions = max_sessions
        self.max_state_bytes = max_state_bytes
        self.session_defaults = session_defaults  # a session's options when its client sets none
        self.pool: SessionPool | None = None
        self.metrics = EngineMetrics(max_sessions)
        self.model_path = model_path
        self.loader = loader or load_voicechat
        self.warm_up = warm_up  # run a silent stream at start-up (compiles kernels)
        self.prompt_cache_bytes = prompt_cache_bytes  # None: the model's default budget
        self.voicechat: Any = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()
        self._commands: queue.Queue[Command | None] = queue.Queue()
        self._aborts: dict[str, threading.Event] = {}  # session -> stop its prefill
        self._reservation = threading.Lock()
        self._reserved: set[str] = set()
        self.refusal = ""  # why the last reservation was refused
        self._jobs = JobQueue()  # engine thread only
        self.transcriptions = JobCounter()  # admitted file transcriptions not yet finished
        self.metrics.transcriptions_in_flight.set_function(lambda: self.transcriptions.in_flight)
        self._transcriber: Any = None
        self.inputs = InputStepper(self.metrics, self._deliver)  # engine thread only
        self.warm_batch_sizes: tuple[int, ...] = ()  # compiled at start-up
        self._thread = threading.Thread(target=self._run, name="mlx-voicechat-engine",
                                        daemon=True)

    # --- lifecycle ------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        for event in list(self._aborts.values()):
            event.set()  # a prefill in progress stops within one position
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self.loaded.is_set() and self.voicechat is not None

    @property
    def config(self) -> Any:
        return self.voicechat.config

    @property
    def language(self) -> str:
        """The language the checkpoint transcribes."""
        from ..runtime.transcribe import checkpoint_language

        return checkpoint_language(self.config)

    @property
    def input_peak_bytes(self) -> int:
        """The most PCM one session's queue ever held."""
        return self.inputs.peak_bytes

    @input_peak_bytes.setter
    def input_peak_bytes(self, value: int) -> None:
        self.inputs.peak_bytes = value

    # --- slot reservations ------------------------------------------------

    def try_reserve(self, session_id: str) -> bool:
        """Hold a slot for ``session_id``; ``False`` (see :attr:`refusal`) when none is left."""
        with self._reservation:
            # A connection admitted but not yet opened counts the least a session reserves.
            pool = self.pool
            least = 0 if pool is None else pool.least_reservation()
            waiting = max(len(self._reserved) - (0 if pool is None else len(pool)), 0)
            reason = admission_error(len(self._reserved), self.max_sessions,
                                     self.reserved_bytes + waiting * least,
                                     self.max_state_bytes, least)
            if reason is not None:
                self.refusal = reason
                self.metrics.refused.inc()
                return False
            self._reserved.add(session_id)
            return True

    def release(self, session_id: str) -> None:
        with self._reservation:
            self._reserved.discard(session_id)

    @property
    def sessions_in_use(self) -> int:
        return len(self._reserved)

    @property
    def state_bytes(self) -> int:
        """Measured bytes of the open sessions' state (updated by the engine thread)."""
        return 0 if self.pool is None else self.pool.state_bytes

    @property
    def reserved_bytes(self) -> int:
        """What the open sessions reserve: their worst-case state (:mod:`..runtime.reservation`)."""
        return 0 if self.pool is None else self.pool.reserved_bytes

    # --- commands (from the event loop) ----------------------------------

    def submit(self, command: Command) -> asyncio.Future:
        """Queue ``command`` now; the future resolves with its reply (call from the loop)."""
        command.loop = asyncio.get_running_loop()
        command.future = command.loop.create_future()
        self._commands.put(command)
        return command.future

    def open(self, session_id: str, options: OpenOptions,
             translator: Translator) -> asyncio.Future:
        """Queue the session's open (a future of its :class:`SessionDetails`); its events
        will be ``translator``'s texts. :meth:`abort` stops its prefill between positions."""
        abort = self._aborts.setdefault(session_id, threading.Event())
        if not isinstance(options, TranscriptionOptions):
            options = replace(options, stop_prefill=abort.is_set)
        return self.submit(Open(session_id, options, translator))

    def abort(self, session_id: str) -> None:
        """Stop ``session_id``'s prefill if it is running (any thread)."""
        event = self._aborts.get(session_id)
        if event is not None:
            event.set()

    def append(self, session_id: str, samples: np.ndarray, feed: Any, tag: object) -> None:
        """Queue PCM for ``session_id`` without waiting (call from the loop).

        Its frames' events, or a frame's error, go to ``feed``
        (an :class:`~.feed.InputFeed`); a failing frame drops the rest of
        the chunks queued with the same ``tag``.
        """
        self._commands.put(Append(session_id, samples, feed, tag))

    async def push(self, session_id: str, samples: np.ndarray) -> list[str]:
        """Queue PCM and await the events of the frames it completes (its partial
        frame stays queued for the next PCM); the first failing frame raises."""
        return await self.submit(Push(session_id, samples))

    async def sync(self, session_id: str) -> None:
        """Wait until every frame queued for ``session_id`` has run and its events went out."""
        await self.submit(Sync(session_id))

    async def flush(self, session_id: str, pad_partial: bool = True) -> list[str]:
        """End the input: the texts of the rest of the stream, in its dialect's order."""
        return await self.submit(Flush(session_id, pad_partial))

    async def cancel(self, session_id: str) -> list[str]:
        return await self.submit(Cancel(session_id))

    async def tool_result(self, session_id: str, call_id: str, output: str) -> list[str]:
        return await self.submit(ToolResult(session_id, call_id, output))

    async def close(self, session_id: str) -> None:
        await self.submit(Close(session_id))

    def submit_transcription(self, audio: np.ndarray, on_delta: DeltaSink | None = None,
                             **options: Any) -> tuple[asyncio.Future, threading.Event]:
        """Queue a file transcription; ``(future of its Transcription, cancel event)``.

        ``on_delta`` gets each step's transcript deltas (on the engine thread).
        The admission slot the caller took (``transcriptions.try_admit``) is
        released on the engine thread when the job ends.
        """
        command = Transcribe(audio, options, on_delta)
        return self.submit(command), command.cancel

    def transcriber(self) -> Any:
        """The perception + RNNT transcriber of the loaded model (engine thread)."""
        if self._transcriber is None:
            from ..runtime.transcribe import Transcriber

            self._transcriber = Transcriber(self.voicechat)
        return self._transcriber

    # --- the thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            logger.info("loading %s", self.model_path)
            self.voicechat = self.loader(self.model_path)
            self.pool = SessionPool(self.voicechat, self.max_sessions, self.max_state_bytes,
                                    self.session_defaults)
            self.metrics.watch_reserved(lambda: self.reserved_bytes)
            if self.prompt_cache_bytes is not None:
                self.voicechat.prompt_cache = PromptCache(self.prompt_cache_bytes)
            logger.info("model loaded")
            if self.warm_up:
                self.warm_batch_sizes = run_warm_up(self.voicechat, self.max_sessions,
                                                    self.step_costs, _clear_cache)
        except Exception as exc:  # reported by /health and to each client
            logger.exception("failed to load %s", self.model_path)
            self.load_error = exc
        finally:
            self.loaded.set()
        self._serve()

    def _serve(self) -> None:
        frame_seconds = self.config.frame_duration if self.voicechat is not None else 0.08
        self.inputs.pool = self.pool
        self.inputs.scheduler = BatchScheduler(self.batch_wait, frame_seconds,
                                               self.batch_fill, self.step_costs)
        while self._cycle():
            pass
        self.inputs.drop_all()
        self._jobs.fail_all(RuntimeError("the server is stopping"))
        if self.pool is not None:
            self.pool.close_all()

    def _cycle(self) -> bool:
        """Take the commands queued so far, run what is due; ``False`` at the stop sentinel."""
        for command in self._take_commands(self._wait_seconds()):
            if command is None:
                return False
            self._dispatch(command)
        self.inputs.run_heads(self._run_command)
        if self.inputs.wait() == 0.0:
            self.inputs.step()
        if self._jobs:  # a job advances at least once per cycle
            self._jobs.step()
        return True

    def _wait_seconds(self) -> float | None:
        """How long to wait for a command: 0 with work due, ``None`` with nothing to do."""
        if self._jobs or self.inputs.commands_due():
            return 0.0
        return self.inputs.wait()

    def _take_commands(self, timeout: float | None) -> list[Command | None]:
        try:
            if timeout == 0.0:
                first = self._commands.get_nowait()
            else:
                first = self._commands.get(timeout=timeout)
        except queue.Empty:
            return []
        commands = [first]
        while first is not None:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
            if commands[-1] is None:
                break
        return commands

    def _dispatch(self, command: Command) -> None:
        if isinstance(command, (Append, Push)):
            self.inputs.add(command)
        elif self.inputs.queue(command):
            pass  # an ordered command: it runs after the audio sent before it
        elif isinstance(command, Transcribe):
            self._add_transcription(command)
        elif isinstance(command, Open):
            self._add_open(command)
        else:
            if isinstance(command, Close):
                self.inputs.drop(command.session_id)
            self._run_command(command)

    def _deliver(self, feed: Any, texts: list[str]) -> None:
        """A frame's event texts to the connection that queued them (on its loop)."""
        notify(feed, "events", texts)

    # --- jobs: file transcriptions and session opens ----------------------------

    def _add_transcription(self, command: Transcribe) -> None:
        """Queue a file transcription; it replies when it ends (or at once if it cannot start)."""
        try:
            self._loaded()
            steps = self.transcriber().steps(command.audio, **command.options)
        except Exception as exc:
            self.transcriptions.release()
            command.reply(error=exc)
            return

        def reply(value: Any = None, error: BaseException | None = None) -> None:
            if error is None:
                self.metrics.transcribed(value.duration)
            command.reply(value, error=error)

        self._jobs.add(StepJob(steps, reply, command.on_delta, command.cancel,
                               self.transcriptions.release))

    def _add_open(self, command: Open) -> None:
        """Open a session as a job: its prompt prefill runs in slices of at most
        ``PREFILL_SLICE_SECONDS`` between the other sessions' steps, so a new
        session's prefill holds them up by one slice at a time."""
        try:
            pool = self._loaded()
        except RuntimeError as exc:
            command.reply(error=exc)
            return
        self._jobs.add(StepJob(self._open_steps(pool, command), command.reply))

    def _open_steps(self, pool: SessionPool, command: Open
                    ) -> Generator[list, None, SessionDetails]:
        session_id, options = command.session_id, command.options
        try:
            opening = pool.open_steps(session_id, options)
            slice_end = time.perf_counter() + PREFILL_SLICE_SECONDS
            while True:
                try:
                    next(opening)
                except StopIteration as opened:
                    stream = opened.value
                    break
                if time.perf_counter() >= slice_end:
                    yield []  # the others' frames run now
                    slice_end = time.perf_counter() + PREFILL_SLICE_SECONDS
        except PoolFull:  # its reservation did not fit: server_busy
            self.metrics.refused.inc()
            raise
        except BaseException:
            _clear_cache()  # what a stopped or failed prefill allocated
            raise
        finally:
            self._aborts.pop(session_id, None)
            self.metrics.sessions(len(pool), pool.state_bytes)
        self.inputs.translators[session_id] = command.translator
        return SessionDetails(stream.sample_rate, self.config.output_sample_rate,
                              stream.frame_samples, stream.options.max_streaming_seconds,
                              isinstance(options, TranscriptionOptions))

    # --- session commands --------------------------------------------------

    def _loaded(self) -> SessionPool:
        """The session pool; ``RuntimeError`` naming the load error when the model failed."""
        if self.pool is None:
            raise RuntimeError(f"model failed to load: {self.load_error}")
        return self.pool

    def _run_command(self, command: Command) -> None:
        try:
            value = self._session_command(self._loaded(), command)
        except Exception as exc:
            # Reported to the client, and logged once there (send_error).
            logger.debug("engine %s failed for %s: %s", type(command).__name__,
                         command.session_id, exc, exc_info=True)
            command.reply(error=exc)
        else:
            command.reply(value)

    def _session_command(self, pool: SessionPool, command: Command) -> Any:
        session_id = command.session_id
        if isinstance(command, Sync):  # every frame queued before it has run
            return None
        if isinstance(command, Close):
            self.inputs.translators.pop(session_id, None)
            if session_id in pool:
                pool.close(session_id)
                self.metrics.sessions(len(pool), pool.state_bytes)
                if not len(pool):
                    _clear_cache()
            return None
        if session_id not in pool:
            raise RuntimeError(NOT_ACTIVE)
        stream, translator = pool.get(session_id), self.inputs.translators[session_id]
        if isinstance(command, Flush):
            before, started = stream.frame_index, time.perf_counter()
            events = pool.flush(session_id, pad_partial=command.pad_partial)
            self.metrics.step(stream.frame_index - before, time.perf_counter() - started,
                              self.config.frame_duration)
            self.metrics.sessions(len(pool), pool.state_bytes)
            return translator.flushed(events, before)
        if isinstance(command, Cancel):
            # A client that cancels always hears it cancelled, also after a
            # failed commit closed the stream.
            return translator.translate(pool.cancel(session_id)
                                        or [Cancelled(stream.frame_index)])
        if isinstance(command, ToolResult):
            stream.submit_tool_result(command.call_id, command.output)
            return []
        raise TypeError(f"not a session command: {command!r}")


def _clear_cache() -> None:
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # pragma: no cover - MLX missing its cache API
        logger.debug("mx.clear_cache failed", exc_info=True)
