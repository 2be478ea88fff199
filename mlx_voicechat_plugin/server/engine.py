"""The engine thread: the only thread that touches MLX.

Socket tasks send ``open``/``append``/``flush``/``cancel``/``close`` commands
over a queue (``submit`` queues one at once) and await a one-shot reply (an
asyncio future the engine resolves via ``loop.call_soon_threadsafe``).
Events come back already serialized to JSON text, base64 audio included, so
the event loop only forwards strings.

The engine holds up to ``max_sessions`` streaming sessions in a
:class:`~..runtime.pool.SessionPool`; a connection reserves a slot when it
is accepted, so admission beyond ``max_sessions`` (or beyond
``max_state_bytes`` of measured session state) is refused at once, and the
reservation is released on every exit path. Audio does not wait for its
reply: a connection hands PCM to its session's input queue
(:meth:`Engine.append`, through a bounded :class:`~.feed.InputFeed`) and its
frames' events come back to the feed as they run; commit, cancel and tool
results queue behind the audio sent before them (:mod:`.scheduler`). The
engine cuts each queue into native frames and runs one pool step over the
sessions with a frame ready, at most one frame each: when every streaming
session has one, or once the ready frames have waited ``batch_wait``
seconds (``--batch-wait-ms``), so clients sending at their own pace fall
into common batched steps, and a silent one costs nothing. A session is a
full conversation or a text-only transcription stream (perception + RNNT
only); both kinds share the pool and its steps.

File transcriptions and session opens are jobs (:mod:`.transcription_jobs`),
stepped round robin after every step and whenever nothing else is due: a
file one step at a time (its perception, then 25 RNNT frames), a prefill in
slices of ``PREFILL_SLICE_SECONDS``, so neither realtime frames, files nor a
new session starve; the caller bounds the files in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

import numpy as np

from ..runtime.audio import as_pcm_chunk
from ..runtime.events import Audio, Cancelled
from ..runtime.options import SessionOptions, TranscriptionOptions
from ..runtime.pool import SessionPool, admission_error, check_budgets
from ..runtime.prompt_cache import PromptCache
from . import protocol
from .limits import DEFAULT_BATCH_WAIT_MS
from .metrics import EngineMetrics
from .scheduler import BatchScheduler, Chunk, SessionInput, StepCosts
from .transcription_jobs import DeltaSink, JobCounter, JobQueue, TranscriptionJob

logger = logging.getLogger(__name__)

# Enough frames for the encoder's attention windows to fill on the released
# checkpoint (70 frames of left context), so the steady shapes are compiled too.
WARM_UP_FRAMES = 80
# Longest a new session's prefill runs before the other sessions' frames do.
PREFILL_SLICE_SECONDS = 0.02
# Steady steps each batch size gets at warm-up (the codec's and RNNT's later shapes).
WARM_UP_STEPS_PER_SIZE = 3
# Commands that wait in a session's input queue behind the audio sent before them.
ORDERED = ("flush", "cancel", "tool_result", "sync")

Loader = Callable[[str], Any]  # checkpoint path -> VoiceChat
Serializer = Callable[[list], list]  # one command's runtime events -> JSON texts


def serialize_vlm(events: list) -> list[str]:
    """The mlx-vlm dialect's events (``protocol.model_event``), the default serializer."""
    return [protocol.dumps(protocol.model_event(e)) for e in events]


def load_voicechat(path: str) -> Any:
    from .. import load

    model, processor = load(path)
    return model.create_session(processor)


@dataclass
class _Command:
    kind: str
    session_id: str
    payload: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future | None = field(repr=False)  # None: nobody awaits it (an append)

    def reply(self, value: Any = None, error: BaseException | None = None) -> None:
        if self.future is None:
            return

        def resolve() -> None:
            if self.future.done():  # the awaiting task was cancelled
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

        try:
            self.loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the loop has closed
            pass


class Engine:
    """One long-lived worker thread owning the model and its streaming sessions."""

    def __init__(self, model_path: str, loader: Loader | None = None,
                 prompt_cache_bytes: int | None = None, warm_up: bool = False,
                 max_sessions: int = 1, max_state_bytes: int | None = None,
                 batch_wait: float = DEFAULT_BATCH_WAIT_MS / 1000, batch_fill: bool = True):
        check_budgets(max_sessions, max_state_bytes)
        if isinstance(batch_wait, bool) or not isinstance(batch_wait, (int, float)) \
                or not batch_wait >= 0:
            raise ValueError(f"batch_wait must be >= 0 seconds, got {batch_wait!r}")
        self.batch_wait = float(batch_wait)  # the collection deadline of a step
        self.batch_fill = batch_fill  # stretch it to fill batches once sessions need batching
        self.step_costs = StepCosts()  # measured step seconds by batch size (warm-up and live)
        self.max_sessions = max_sessions
        self.max_state_bytes = max_state_bytes
        self.pool: SessionPool | None = None
        self.metrics = EngineMetrics(max_sessions)
        self.model_path = model_path
        self.loader = loader or load_voicechat
        self.warm_up = warm_up  # run a silent stream at start-up (compiles kernels)
        self.prompt_cache_bytes = prompt_cache_bytes  # None: the model's default budget
        self.voicechat: Any = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._aborts: dict[str, threading.Event] = {}  # session -> stop its prefill
        self._reservation = threading.Lock()
        self._reserved: set[str] = set()
        self.refusal = ""  # why the last reservation was refused
        self._jobs = JobQueue()  # engine thread only
        self._serializers: dict[str, Serializer] = {}  # session -> its dialect (engine thread)
        self.transcriptions = JobCounter()  # admitted file transcriptions not yet finished
        self.metrics.transcriptions_in_flight.set_function(lambda: self.transcriptions.in_flight)
        self._transcriber: Any = None
        self._inputs: dict[str, SessionInput] = {}  # session -> its input queue (engine thread)
        self._scheduler: BatchScheduler | None = None
        self.input_peak_bytes = 0  # the most PCM one session's queue ever held
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

    # --- slot reservations ------------------------------------------------

    def try_reserve(self, session_id: str) -> bool:
        """Hold a slot for ``session_id``; ``False`` (see :attr:`refusal`) when none is left."""
        with self._reservation:
            reason = admission_error(len(self._reserved), self.max_sessions, self.state_bytes,
                                     self.max_state_bytes)
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
    def busy(self) -> bool:
        return len(self._reserved) >= self.max_sessions

    @property
    def sessions_in_use(self) -> int:
        return len(self._reserved)

    @property
    def state_bytes(self) -> int:
        """Measured bytes of the open sessions' state (updated by the engine thread)."""
        return 0 if self.pool is None else self.pool.state_bytes

    # --- commands (awaited from the event loop) ------------------------

    def submit(self, kind: str, session_id: str, **payload: Any) -> asyncio.Future:
        """Queue a command now; the future resolves with its reply (call from the loop)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(_Command(kind, session_id, payload, loop, future))
        return future

    async def call(self, kind: str, session_id: str, **payload: Any) -> Any:
        return await self.submit(kind, session_id, **payload)

    def submit_open(self, session_id: str, **options: Any) -> asyncio.Future:
        """Queue ``open``; :meth:`abort` stops its prefill between positions.

        ``serializer`` (optional) turns the session's events into the texts
        sent; it runs on the engine thread (default :func:`serialize_vlm`).
        """
        abort = self._aborts.setdefault(session_id, threading.Event())
        return self.submit("open", session_id, stop_prefill=abort.is_set, **options)

    def abort(self, session_id: str) -> None:
        """Stop ``session_id``'s prefill if it is running (any thread)."""
        event = self._aborts.get(session_id)
        if event is not None:
            event.set()

    def append(self, session_id: str, samples: np.ndarray, sample_rate: int | None, feed: Any,
               tag: object) -> None:
        """Queue PCM for ``session_id`` without waiting (call from the loop).

        Its frames' events, or a frame's error, go to ``feed``
        (an :class:`~.feed.InputFeed`); a failing frame drops the rest of
        the chunks queued with the same ``tag``.
        """
        self._commands.put(_Command("append", session_id,
                                    {"samples": samples, "sample_rate": sample_rate,
                                     "feed": feed, "tag": tag}, feed.loop, None))

    async def push(self, session_id: str, samples: np.ndarray, sample_rate: int) -> list[str]:
        """Queue PCM and await the events of the frames it completes (its partial
        frame stays queued for the next PCM); the first failing frame raises."""
        return await self.call("append", session_id, samples=samples, sample_rate=sample_rate,
                               feed=None, tag=object())

    async def sync(self, session_id: str) -> None:
        """Wait until every frame queued for ``session_id`` has run and its events went out."""
        await self.call("sync", session_id)

    async def flush(self, session_id: str, pad_partial: bool = True) -> tuple[list[str], list[str]]:
        """End the input: ``(events of frames run before the commit, the rest)``."""
        return await self.call("flush", session_id, pad_partial=pad_partial)

    async def cancel(self, session_id: str) -> list[str]:
        return await self.call("cancel", session_id)

    async def tool_result(self, session_id: str, call_id: str, output: str) -> list[str]:
        return await self.call("tool_result", session_id, call_id=call_id, output=output)

    def submit_transcription(self, audio: np.ndarray, on_delta: DeltaSink | None = None,
                             **options: Any) -> tuple[asyncio.Future, threading.Event]:
        """Queue a file transcription; ``(future of its Transcription, cancel event)``.

        The admission slot the caller took (``transcriptions.try_admit``) is
        released on the engine thread when the job ends.
        """
        cancel = threading.Event()
        future = self.submit("transcribe", "", audio=audio, on_delta=on_delta, cancel=cancel,
                             options=options)
        return future, cancel

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
            self.pool = SessionPool(self.voicechat, self.max_sessions, self.max_state_bytes)
            if self.prompt_cache_bytes is not None:
                self.voicechat.prompt_cache = PromptCache(self.prompt_cache_bytes)
            logger.info("model loaded")
            if self.warm_up:
                self._warm_up()
        except Exception as exc:  # reported by /health and to each client
            logger.exception("failed to load %s", self.model_path)
            self.load_error = exc
        finally:
            self.loaded.set()
        self._serve()

    def _warm_up(self, frames: int = WARM_UP_FRAMES) -> None:
        """Silent streams at every batch size, so compiled kernels exist before the first client.

        One stream alone (through flush), then ``max_sessions`` streams stepped
        together past the encoder's windows, closed one by one with a few
        steady steps at each size: every step size 1..max_sessions a live
        client can meet has been traced (and, on a cold kernel cache, built).
        """
        started = time.perf_counter()
        stream = self.voicechat.create_streaming_session()
        stream.push_audio(np.zeros(frames * stream.frame_samples, np.float32))
        stream.flush()
        if self.max_sessions > 1:
            self._warm_up_batches(frames)
        _clear_cache()
        self.warm_batch_sizes = tuple(range(1, self.max_sessions + 1))
        costs = self.step_costs.by_size
        logger.info("warm-up: batch sizes 1-%d compiled in %.1f s (%d silent frames each); "
                    "steps of %s", self.max_sessions, time.perf_counter() - started, frames,
                    ", ".join(f"{n}: {1000 * costs[n]:.0f} ms" for n in sorted(costs)))
        from ..loader import read_config
        from ..runtime import compile_policy

        path = getattr(self.voicechat.model, "model_path", None)
        if path is not None:  # later short CLI runs of this model may compile
            compile_policy.mark_warm(compile_policy.model_key(read_config(path)))

    def _warm_up_batches(self, frames: int) -> None:
        pool = SessionPool(self.voicechat, self.max_sessions)
        silence = np.zeros(self.config.frame_samples, np.float32)
        ids = [f"warm-up-{i}" for i in range(self.max_sessions)]
        try:
            for seed, session_id in enumerate(ids):
                pool.open(session_id, SessionOptions(seed=seed))
            for _ in range(frames):
                result = pool.step({k: (silence, None) for k in ids})
            self.step_costs.record(len(ids), result.seconds)
            for size in range(self.max_sessions - 1, 0, -1):
                pool.close(ids[size])
                for _ in range(WARM_UP_STEPS_PER_SIZE):
                    result = pool.step({k: (silence, None) for k in ids[:size]})
                self.step_costs.record(size, result.seconds)  # the scheduler's first figures
        finally:
            pool.close_all()

    def _serve(self) -> None:
        self._scheduler = BatchScheduler(self.batch_wait, self._frame_seconds(),
                                         self.batch_fill, self.step_costs)
        while self._cycle():
            pass
        for session_id in list(self._inputs):
            self._drop_input(session_id)
        self._jobs.fail_all(RuntimeError("the server is stopping"))
        if self.pool is not None:
            self.pool.close_all()

    def _frame_seconds(self) -> float:
        return self.config.frame_duration if self.voicechat is not None else 0.08

    def _cycle(self) -> bool:
        """Take the commands queued so far, run what is due; ``False`` at the stop sentinel."""
        for command in self._take_commands(self._wait_seconds()):
            if command is None:
                return False
            self._dispatch(command)
        self._run_heads()
        if self._scheduler.wait(self._inputs, time.perf_counter()) == 0.0:
            self._step_inputs()
        if self._jobs:  # a job advances at least once per cycle
            self._jobs.step()
        return True

    def _wait_seconds(self) -> float | None:
        """How long to wait for a command: 0 with work due, ``None`` with nothing to do."""
        if self._jobs or any(i.head_command() is not None for i in self._inputs.values()):
            return 0.0
        return self._scheduler.wait(self._inputs, time.perf_counter())

    def _take_commands(self, timeout: float | None) -> list[_Command | None]:
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

    def _dispatch(self, command: _Command) -> None:
        kind, session_id = command.kind, command.session_id
        if kind == "append":
            self._append(command)
        elif kind in ORDERED and self._inputs.get(session_id) is not None \
                and self._inputs[session_id].items:
            self._inputs[session_id].add_command(command)  # after the audio sent before it
        elif kind == "transcribe":
            self._add_job(command)
        elif kind == "open":
            self._add_open(command)
        else:
            if kind == "close":
                self._drop_input(session_id)
            self._run_command(command)

    def _add_job(self, command: _Command) -> None:
        """Queue a file transcription; it replies when it ends (or at once if it cannot start)."""
        payload = command.payload
        try:
            self._loaded()
            steps = self.transcriber().steps(payload["audio"], **payload["options"])
        except Exception as exc:
            self.transcriptions.release()
            command.reply(error=exc)
            return
        def reply(value: Any = None, error: BaseException | None = None) -> None:
            if error is None:
                self.metrics.transcribed(value.duration)
            command.reply(value, error=error)

        self._jobs.add(TranscriptionJob(
            steps, reply, payload["on_delta"],
            lambda e: protocol.dumps(protocol.model_event(e)), payload["cancel"],
            self.transcriptions.release))

    # --- session input queues (engine thread) -------------------------------

    def _append(self, command: _Command) -> None:
        """A chunk of PCM for a session's queue (validated now, framed later)."""
        payload, session_id = command.payload, command.session_id
        feed = payload["feed"]
        chunk = Chunk(payload["samples"], payload["tag"], feed, None if feed else command)
        try:
            pool = self._loaded()
            if session_id not in pool:
                raise RuntimeError("realtime session is not active")
            stream = pool.get(session_id)
            rate = payload["sample_rate"] or stream.sample_rate
            if rate != stream.sample_rate:
                raise ValueError(f"sample_rate must be {stream.sample_rate} Hz, got {rate}")
            if stream.closed:
                raise RuntimeError("streaming session is closed")
            chunk.samples = as_pcm_chunk(payload["samples"])
        except Exception as exc:
            self._consumed([(feed, _length(payload["samples"]))])
            self._fail(chunk, exc)
            return
        queue_ = self._inputs.get(session_id)
        if queue_ is None:
            queue_ = self._inputs[session_id] = SessionInput(stream.frame_samples,
                                                             stream.sample_rate)
        queue_.add_chunk(chunk, time.perf_counter())
        self.input_peak_bytes = max(self.input_peak_bytes, queue_.nbytes)
        self._answer_settled(queue_)

    def _run_heads(self) -> None:
        """Run the commands that reached the head of their session's queue."""
        for session_id, queue_ in list(self._inputs.items()):
            while (command := queue_.head_command()) is not None:
                if queue_.items[0] is not command:  # a partial frame first: the stream keeps it
                    samples, consumed, finished = queue_.take_residual()
                    self._stage(session_id, samples, finished)
                    self._consumed(consumed)
                queue_.pop_command(time.perf_counter())
                self._run_command(command)

    def _stage(self, session_id: str, samples: np.ndarray, finished: list[Chunk]) -> None:
        """Hand a partial frame to the session's stream (it runs no frame)."""
        result = self.pool.step({session_id: (samples, self._inputs[session_id].rate)})
        error = result.errors.get(session_id)
        if error is not None and finished:
            self._fail(finished[-1], error)
        for chunk in finished:
            self._answer(chunk)

    def _step_inputs(self) -> None:
        """One pool step: a frame of every session that has one ready."""
        pool, scheduler = self._loaded(), self._scheduler
        ready = scheduler.ready(self._inputs)
        now = started = time.perf_counter()
        waited = now - scheduler.collection_start(self._inputs, ready)
        frames = {k: self._inputs[k].take_frame(now) for k in ready}
        result = pool.step({k: (f.samples, self._inputs[k].rate) for k, f in frames.items()})
        self.metrics.step(result.frames, result.seconds, self.config.frame_duration)
        self.metrics.collected(waited)
        for session_id, frame in frames.items():
            queue_ = self._inputs[session_id]
            error = result.errors.get(session_id)
            if error is not None:
                logger.debug("engine frame failed for %s: %s", session_id, error, exc_info=error)
                consumed, _ = queue_.drop_tag(frame.owner.tag, time.perf_counter())
                frame.consumed += consumed
                self._fail(frame.owner, error)
            else:
                texts = self._serializer(session_id)(result.events[session_id])
                if frame.owner.reply is not None:
                    frame.owner.events += texts
                elif frame.owner.feed is not None and texts:
                    self._deliver(frame.owner.feed, texts)
            for chunk in frame.finished:
                self._answer(chunk)
            self._answer_settled(queue_)
            self._consumed(frame.consumed)
        self.metrics.sessions(len(pool), pool.state_bytes)
        self.metrics.buffered(sum(q.buffered for q in self._inputs.values())
                              / self.config.input_sample_rate)
        scheduler.free_since = time.perf_counter()
        scheduler.record(result.frames, scheduler.free_since - started)

    def _deliver(self, feed: Any, texts: list[str]) -> None:
        """A frame's event texts to the connection that queued it (on its loop)."""
        _notify(feed, "events", texts)

    def _answer_settled(self, queue_: SessionInput) -> None:
        for chunk in list(queue_.settled()):
            self._answer(chunk)

    @staticmethod
    def _answer(chunk: Chunk) -> None:
        """Reply to a push with the events of the frames it completed."""
        if chunk.reply is not None:
            chunk.reply.reply(chunk.events)
            chunk.reply = None

    @staticmethod
    def _fail(chunk: Chunk, error: BaseException) -> None:
        if chunk.reply is not None:
            chunk.reply.reply(error=error)
            chunk.reply = None
        elif chunk.feed is not None:
            _notify(chunk.feed, "failed", error)

    @staticmethod
    def _consumed(consumed: list[tuple[Any, int]]) -> None:
        """Tell each feed how many of its samples left the queue (its room for more)."""
        totals: dict[int, tuple[Any, int]] = {}
        for feed, samples in consumed:
            if feed is not None and samples:
                totals[id(feed)] = (feed, totals.get(id(feed), (feed, 0))[1] + samples)
        for feed, samples in totals.values():
            _notify(feed, "consumed", samples)

    def _drop_input(self, session_id: str) -> None:
        """Forget a closing session's queue; what waits in it is answered with an error."""
        queue_ = self._inputs.pop(session_id, None)
        if queue_ is None:
            return
        gone = RuntimeError("realtime session is not active")
        for item in queue_.drain():
            if isinstance(item, Chunk):
                self._consumed([(item.feed, item.left)])
                if item.reply is not None:
                    item.reply.reply(error=gone)
            else:
                item.reply(error=gone)

    def _run_command(self, command: _Command) -> None:
        try:
            value = self._command(self._loaded(), command)
        except Exception as exc:
            # Reported to the client, and logged once there (send_error).
            logger.debug("engine %s failed for %s: %s", command.kind,
                         command.session_id, exc, exc_info=True)
            command.reply(error=exc)
        else:
            command.reply(value)

    def _add_open(self, command: _Command) -> None:
        """Open a session as a job: its prompt prefill runs in slices of at most
        ``PREFILL_SLICE_SECONDS`` between the other sessions' steps, so a new
        session's prefill holds them up by one slice at a time."""
        try:
            pool = self._loaded()
        except RuntimeError as exc:
            command.reply(error=exc)
            return
        self._jobs.add(TranscriptionJob(self._open_steps(pool, command), command.reply))

    def _loaded(self) -> SessionPool:
        """The session pool; ``RuntimeError`` naming the load error when the model failed."""
        if self.pool is None:
            raise RuntimeError(f"model failed to load: {self.load_error}")
        return self.pool

    def _open_steps(self, pool: SessionPool, command: _Command) -> Generator[list, None, Any]:
        session_id = command.session_id
        options = dict(command.payload)
        serializer = options.pop("serializer", None) or serialize_vlm
        kind = TranscriptionOptions if options.pop("text_only", False) else SessionOptions
        try:
            opening = pool.open_steps(session_id, kind(**options))
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
        except BaseException:
            _clear_cache()  # what a stopped or failed prefill allocated
            raise
        finally:
            self._aborts.pop(session_id, None)
            self.metrics.sessions(len(pool), pool.state_bytes)
        self._serializers[session_id] = serializer
        return {
            "input_sample_rate": stream.sample_rate,
            "output_sample_rate": self.config.output_sample_rate,
            "frame_samples": stream.frame_samples,
            "max_streaming_seconds": stream.options.max_streaming_seconds,
            "text_only": getattr(stream, "text_only", False),
        }

    def _command(self, pool: SessionPool, command: _Command) -> Any:
        session_id = command.session_id
        serialize = self._serializer(session_id)
        if command.kind == "sync":  # every frame queued before it has run
            return None
        if command.kind == "close":
            self._serializers.pop(session_id, None)
            if session_id in pool:
                pool.close(session_id)
                self.metrics.sessions(len(pool), pool.state_bytes)
                if not len(pool):
                    _clear_cache()
            return None
        if session_id not in pool:
            raise RuntimeError("realtime session is not active")
        stream = pool.get(session_id)
        if command.kind == "flush":
            before, started = stream.frame_index, time.perf_counter()
            events = pool.flush(session_id, pad_partial=command.payload["pad_partial"])
            self.metrics.step(stream.frame_index - before, time.perf_counter() - started,
                              self.config.frame_duration)
            self.metrics.sessions(len(pool), pool.state_bytes)
            # Events of frames run before the commit (the last such frame's
            # audio) go out before ``committed``.
            lead = 0
            while lead < len(events) and events[lead].frame_index < before \
                    and isinstance(events[lead], Audio):
                lead += 1
            return serialize(events[:lead]), serialize(events[lead:])
        if command.kind == "cancel":
            # A client that cancels always hears response.cancelled, also
            # after a failed commit closed the stream.
            events = pool.cancel(session_id) or [Cancelled(stream.frame_index)]
        elif command.kind == "tool_result":
            stream.submit_tool_result(command.payload["call_id"], command.payload["output"])
            events = []
        else:
            raise ValueError(f"unknown engine command {command.kind!r}")
        return serialize(events)

    def _serializer(self, session_id: str) -> Serializer:
        return self._serializers.get(session_id, serialize_vlm)


def _notify(feed: Any, method: str, value: Any) -> None:
    """Call ``feed.method(value)`` on the feed's event loop, in order."""
    try:
        feed.loop.call_soon_threadsafe(getattr(feed, method), value)
    except RuntimeError:  # the loop has closed
        pass


def _length(samples: Any) -> int:
    shape = getattr(samples, "shape", None)
    return int(shape[0]) if shape else 0


def _clear_cache() -> None:
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # pragma: no cover - MLX missing its cache API
        logger.debug("mx.clear_cache failed", exc_info=True)
