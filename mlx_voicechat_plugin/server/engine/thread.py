"""The engine thread: the only thread that touches MLX.

Socket tasks queue :mod:`.commands` (:meth:`Engine.submit`) and await a
one-shot reply (an asyncio future resolved via ``loop.call_soon_threadsafe``).
A session's output leaves the engine as runtime events: once per cycle, one
hand-off per session to its sink (its connection) on the event loop, with
the frames' events, the marker replies in order and the client samples
consumed (:mod:`.channel`). The connection translates them into its dialect
there; the engine speaks no dialect, makes no JSON and encodes no audio.

Up to ``max_sessions`` streaming sessions share a
:class:`~..runtime.pool.StreamPool`; a connection reserves a slot when it is
accepted (refused at once by :mod:`.admission`: draining, ``max_sessions``, or
``max_state_bytes`` of reserved worst-case state),
released on every exit path. Audio does not wait for its reply: a connection
hands PCM to its session's channel (:meth:`Engine.append`, through a bounded
:class:`~.feed.InputFeed`); commit, cancel and tool results are markers in
the same channel, behind it; one pool step runs the sessions with a frame
ready (:mod:`.stepping`, when :mod:`.scheduler` says so). A session is a full
conversation or a text-only transcription stream; both share the steps.

File transcriptions and session opens are jobs (:mod:`.jobs`), stepped round
robin after every step and whenever nothing else is due (a file's perception,
then 25 RNNT frames a step; a prefill in slices, which :meth:`Engine.abort`
stops), so neither realtime frames, files nor a new session starve.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from typing import Any, Callable, Generator

import numpy as np

from ...loader import plain_cause
from ...runtime.framing import Chunk
from ...runtime.ledger import ReservationLedger
from ...runtime.pool import PoolFull, StreamPool
from ...runtime.prompt_cache import PromptCache
from .admission import Admission
from .channel import FrameError, Handoff, Sink, hand_off
from .commands import (
    Append, Cancel, Close, Command, DeltaSink, Flush, Open, OpenOptions, SessionDetails, Sync,
    ToolResult, Transcribe, take_commands,
)
from .jobs import JobCounter, JobQueue, StepJob
from ..limits import DEFAULT_BATCH_WAIT_MS
from .metrics import EngineMetrics
from .scheduler import BatchScheduler, StepCosts
from .stepping import NOT_ACTIVE, Stepper
from .warm_up import run_warm_up

logger = logging.getLogger(__name__)

Loader = Callable[[str], Any]  # checkpoint path -> VoiceChat


def load_voicechat(path: str, memory_budget: float | None = None) -> Any:
    from ... import load

    model, processor = load(path, memory_budget=memory_budget)
    return model.create_session(processor)


class Engine:
    """One long-lived worker thread owning the model and its streaming sessions."""

    def __init__(self, model_path: str, loader: Loader | None = None,
                 prompt_cache_bytes: int | None = None, warm_up: bool = False,
                 max_sessions: int = 1, max_state_bytes: int | None = None,
                 batch_wait: float = DEFAULT_BATCH_WAIT_MS / 1000, batch_fill: bool = True,
                 session_defaults: Any = None, memory_budget: float | None = None):
        """``memory_budget``: the GiB the model and its sessions may use (the device's by
        default); the default loader plans against it and, once loaded,
        ``max_sessions`` and ``max_state_bytes`` are fitted to what it leaves
        (:func:`~...budget.fit_sessions`)."""
        # Slots, reservations and their bounds (checked there): admission's and the pool's.
        self.ledger = ReservationLedger(max_sessions, max_state_bytes)
        self.batch_wait = float(batch_wait)  # the collection deadline of a step
        self.batch_fill = batch_fill  # stretch it to fill batches once sessions need batching
        self.step_costs = StepCosts()  # measured step seconds by batch size (warm-up and live)
        self.session_defaults = session_defaults  # a session's options when its client sets none
        self.pool: StreamPool | None = None
        self.metrics = EngineMetrics(max_sessions)
        self.model_path = model_path
        self.loader = loader or functools.partial(load_voicechat, memory_budget=memory_budget)
        self.warm_up = warm_up  # run a silent stream at start-up (compiles kernels)
        self.prompt_cache_bytes = prompt_cache_bytes  # None: the model's default budget
        self.voicechat: Any = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()
        self._commands: queue.Queue[Command | None] = queue.Queue()
        self._aborts: dict[str, threading.Event] = {}  # session -> stop its prefill
        self.admission = Admission(self.ledger, self.metrics.refused)
        self._jobs = JobQueue()  # engine thread only
        self.transcriptions = JobCounter()  # admitted file transcriptions not yet finished
        self.metrics.transcriptions_in_flight.set_function(lambda: self.transcriptions.in_flight)
        self._transcriber: Any = None
        self.stepper: Stepper | None = None  # the sessions' channels: made by the engine thread
        self.input_peak_bytes = 0  # the most PCM one session's channel ever held
        self.warm_batch_sizes: tuple[int, ...] = ()  # compiled at start-up
        self._thread = threading.Thread(target=self._run, name="mlx-voicechat-engine",
                                        daemon=True)

    @property
    def max_sessions(self) -> int:
        """``--max-sessions``, fitted to memory at load (the ledger's bound)."""
        return self.ledger.max_sessions

    @property
    def max_state_bytes(self) -> int | None:
        """``--max-state-bytes``, fitted to memory at load (the ledger's bound)."""
        return self.ledger.max_state_bytes

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
    def running(self) -> bool:
        """Whether the engine thread is alive (a dead one serves no one: see :mod:`.replica`)."""
        return self._thread.is_alive()

    @property
    def config(self) -> Any:
        return self.voicechat.config

    @property
    def memory_plan(self) -> Any:
        """The loaded model's memory plan (``None``: not loaded, or a loader of its own)."""
        return getattr(getattr(self.voicechat, "model", None), "memory_plan", None)

    @property
    def language(self) -> str:
        """The language the checkpoint transcribes."""
        from ...runtime.transcribe import checkpoint_language

        return checkpoint_language(self.config)

    # --- commands (from the event loop) ----------------------------------

    def submit(self, command: Command) -> asyncio.Future:
        """Queue ``command`` now; the future resolves with its reply (call from the loop)."""
        command.loop = asyncio.get_running_loop()
        command.future = command.loop.create_future()
        self._commands.put(command)
        return command.future

    def open(self, session_id: str, options: OpenOptions, sink: Sink) -> asyncio.Future:
        """Queue the session's open (a future of its :class:`SessionDetails`); its
        hand-offs go to ``sink``. :meth:`abort` stops its prefill between positions."""
        self._aborts.setdefault(session_id, threading.Event())
        return self.submit(Open(session_id, options, sink))

    def abort(self, session_id: str) -> None:
        """Stop ``session_id``'s prefill if it is running (any thread)."""
        event = self._aborts.get(session_id)
        if event is not None:
            event.set()

    def append(self, session_id: str, samples: np.ndarray, sink: Sink | None,
               tag: object) -> None:
        """Queue the client's PCM for ``session_id`` without waiting (call from the loop).

        Its frames' events, or a frame's error, go to the session's sink; a
        failing frame drops the rest of the chunks queued with the same
        ``tag``; ``sink`` hears of it when the session is not open.
        """
        self._commands.put(Append(session_id, samples, sink, tag))

    async def push(self, session_id: str, samples: np.ndarray) -> None:
        """The server's own PCM (silence), queued behind the client's audio in the same
        channel; returns once it has run and its events went to the session's sink."""
        self._commands.put(Append(session_id, samples, None, object(), counted=False))
        await self.sync(session_id)

    async def sync(self, session_id: str) -> None:
        """Wait until every frame queued for ``session_id`` has run and its events went out."""
        await self.submit(Sync(session_id))

    async def flush(self, session_id: str, pad_partial: bool = True) -> list:
        """End the input: the runtime events of the rest of the stream."""
        return await self.submit(Flush(session_id, pad_partial))

    async def cancel(self, session_id: str) -> list:
        """End the stream now: its runtime events (``Cancelled`` among them)."""
        return await self.submit(Cancel(session_id))

    async def tool_result(self, session_id: str, call_id: str, output: str) -> None:
        await self.submit(ToolResult(session_id, call_id, output))

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
            from ...runtime.transcribe import Transcriber

            self._transcriber = Transcriber(self.voicechat)
        return self._transcriber

    # --- the thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            logger.info("loading %s", self.model_path)
            self.voicechat = self.loader(self.model_path)
            self._fit_to_memory()
            self.pool = StreamPool(self.voicechat, self.max_sessions, self.max_state_bytes,
                                    self.session_defaults, self.ledger)
            self._report_admission()
            self.metrics.watch_reserved(lambda: self.admission.reserved_bytes)
            if self.prompt_cache_bytes is not None:
                self.voicechat.prompt_cache = PromptCache(self.prompt_cache_bytes)
            logger.info("model loaded")
            if self.warm_up:
                self.warm_batch_sizes = run_warm_up(self.voicechat, self.max_sessions,
                                                    self.step_costs, _clear_cache)
        except Exception as exc:  # reported by /health and to each client; a bug's traceback
            logger.error("failed to load the model: %s", exc, exc_info=not plain_cause(exc))
            self.load_error = exc
        finally:
            self.loaded.set()
        try:
            self._serve()
        finally:
            _mlx_free("clear_streams")

    def _fit_to_memory(self) -> None:
        """Size the session bounds to what the model's memory plan leaves, and say so."""
        plan = self.memory_plan
        if plan is None:  # a loader of its own (tests): the bounds stay as given
            return
        from ...budget import fit_sessions

        sessions, state, line = fit_sessions(plan, self.max_sessions, self.max_state_bytes)
        (logger.warning if sessions < self.max_sessions else logger.info)("%s", line)
        self.ledger.bound(sessions, state)
        self.metrics.capacity.set(sessions)

    def _report_admission(self) -> None:
        """Say how many sessions with the default options the bounds admit (the ledger's
        rule on an empty server), and warn when none is."""
        admitted = self.ledger.admissible(0, 0)
        if admitted == 0:
            logger.warning("no realtime session will be admitted: %s",
                           self.ledger.refusal(0, 0))
        else:
            logger.info("the bounds admit %d realtime session(s) with the default options "
                        "(each reserving %d bytes of state)", admitted, self.ledger.least)

    def _serve(self) -> None:
        frame_seconds = self.config.frame_duration if self.voicechat is not None else 0.08
        scheduler = BatchScheduler(self.batch_wait, frame_seconds, self.batch_fill,
                                   self.step_costs)
        self.stepper = Stepper(self.metrics, self.pool, scheduler)
        while self._cycle():
            pass
        self.stepper.drop_all()
        self._jobs.fail_all(RuntimeError("the server is stopping"))
        if self.pool is not None:
            self.pool.close_all()

    def _cycle(self) -> bool:
        """Take the commands queued so far, run what is due; ``False`` at the stop sentinel."""
        for command in take_commands(self._commands, self._wait_seconds()):
            if command is None:
                return False
            self._dispatch(command)
        self.stepper.run_markers()
        if self.stepper.wait() == 0.0:
            self.stepper.step()
        if self._jobs:  # a job advances at least once per cycle
            self._jobs.step()
        self.stepper.send()  # one hand-off per session with output
        return True

    def _wait_seconds(self) -> float | None:
        """How long to wait for a command: 0 with work due, ``None`` with nothing to do."""
        if self._jobs or self.stepper.markers_due():
            return 0.0
        return self.stepper.wait()

    def _dispatch(self, command: Command) -> None:
        if isinstance(command, Append):
            self._append(command)
        elif command.ordered:  # a marker: it runs after the audio sent before it
            if not self.stepper.add_marker(command):
                # A barrier for a session that is not open has nothing to wait for.
                command.reply(None) if isinstance(command, Sync) \
                    else command.reply(error=RuntimeError(NOT_ACTIVE))
        elif isinstance(command, Transcribe):
            self._add_transcription(command)
        elif isinstance(command, Open):
            self._add_open(command)
        elif isinstance(command, Close):
            self._close(command)
        else:
            command.reply(error=TypeError(f"not an engine command: {command!r}"))

    def _append(self, command: Append) -> None:
        """PCM into its session's channel (framed there), or its refusal to ``sink``."""
        channel = self.stepper.channels.get(command.session_id)
        if channel is None:
            length = command.samples.shape[0] if command.counted else 0
            hand_off(command.sink, Handoff([FrameError(RuntimeError(NOT_ACTIVE))], length))
            return
        channel.add_chunk(Chunk(command.samples, command.tag, command.counted),
                          time.perf_counter())
        self.input_peak_bytes = max(self.input_peak_bytes, channel.nbytes)

    # --- jobs: file transcriptions and session opens ----------------------------

    def _add_transcription(self, command: Transcribe) -> None:
        """Queue a file transcription; it replies when it ends (or at once if it cannot start)."""
        try:
            self._loaded()
            steps = self.transcriber().steps(command.audio, **command.options)
        except Exception as exc:
            self.transcriptions.ended()
            command.reply(error=exc)
            return

        def reply(value: Any = None, error: BaseException | None = None) -> None:
            if error is None:
                self.metrics.transcribed(value.duration)
            command.reply(value, error=error)

        self._jobs.add(StepJob(steps, reply, command.on_delta, command.cancel,
                               self.transcriptions.ended))

    def _add_open(self, command: Open) -> None:
        """Open a session as a job (its prefill in slices, :meth:`Stepper.open_steps`);
        :meth:`abort` stops it between two positions."""
        try:
            self._loaded()
        except RuntimeError as exc:
            command.reply(error=exc)
            return
        self._jobs.add(StepJob(self._opening(command), command.reply))

    def _opening(self, command: Open) -> Generator[list, None, SessionDetails]:
        abort = self._aborts.get(command.session_id) or threading.Event()
        try:
            return (yield from self.stepper.open_steps(command, abort))
        except PoolFull:  # its reservation did not fit: server_busy
            self.metrics.refused.inc()
            raise
        except BaseException:
            _clear_cache()  # what a stopped or failed prefill allocated
            raise
        finally:
            self._aborts.pop(command.session_id, None)

    # --- session commands --------------------------------------------------

    def _loaded(self) -> StreamPool:
        """The session pool; ``RuntimeError`` naming the load error when the model failed."""
        if self.pool is None:
            raise RuntimeError(f"model failed to load: {self.load_error}")
        return self.pool

    def _close(self, command: Close) -> None:
        """Forget the session: its channel's markers answered, its stream cancelled."""
        session_id = command.session_id
        self.stepper.drop(session_id)
        try:
            pool = self._loaded()
        except RuntimeError as exc:
            command.reply(error=exc)
            return
        if session_id in pool:
            pool.close(session_id)
            self.metrics.sessions(len(pool), pool.state_bytes)
            if not len(pool):
                _clear_cache()
        command.reply(None)


def _clear_cache() -> None:
    _mlx_free("clear_cache")


def _mlx_free(name: str) -> None:
    """``mx.clear_cache`` (no session left) or ``mx.clear_streams`` (this thread's streams
    before it ends: MLX leaves that to each thread, and a process whose engine thread
    skipped it aborts at exit, status 134, instead of exiting 0 after a graceful stop)."""
    try:
        import mlx.core as mx

        getattr(mx, name)()
    except Exception:  # pragma: no cover - an MLX without it cleans up itself
        logger.debug("mx.%s failed", name, exc_info=True)
