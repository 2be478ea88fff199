"""The engine thread: the only thread that touches MLX.

Socket tasks send ``open``/``push``/``flush``/``cancel``/``close`` commands over
a queue (``submit`` queues one at once) and await a one-shot reply (an asyncio future the engine resolves via
``loop.call_soon_threadsafe``). Events come back already serialized to JSON
text, base64 audio included, so the event loop only forwards strings.

The engine holds up to ``max_sessions`` streaming sessions in a
:class:`~..runtime.pool.SessionPool`; a connection reserves a slot when it
is accepted, so admission beyond ``max_sessions`` (or beyond
``max_state_bytes`` of measured session state) is refused at once, and the
reservation is released on every exit path. Each turn of the thread takes
every command queued so far and runs the audio frames among them as one
pool step (at most one frame per session: a connection sends one frame per
command and awaits it), so N clients share steps fairly. A session is a full
conversation or a text-only transcription stream (perception + RNNT only);
both kinds share the pool and its steps.

File transcriptions and session opens are jobs (:mod:`.transcription_jobs`),
stepped round robin after every turn and whenever no command waits: a file
one step at a time (its perception, then 25 RNNT frames), a prefill in
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

from ..runtime.events import Audio, Cancelled
from ..runtime.pool import SessionPool, admission_error, check_budgets
from ..runtime.prompt_cache import PromptCache
from . import protocol
from .metrics import EngineMetrics
from .transcription_jobs import DeltaSink, JobCounter, JobQueue, TranscriptionJob

logger = logging.getLogger(__name__)

# Enough frames for the encoder's attention windows to fill on the released
# checkpoint (70 frames of left context), so the steady shapes are compiled too.
WARM_UP_FRAMES = 80
# Longest a new session's prefill runs before the other sessions' frames do.
PREFILL_SLICE_SECONDS = 0.02

Loader = Callable[[str], Any]  # checkpoint path -> VoiceChatSession
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
    future: asyncio.Future = field(repr=False)

    def reply(self, value: Any = None, error: BaseException | None = None) -> None:
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
                 max_sessions: int = 1, max_state_bytes: int | None = None):
        check_budgets(max_sessions, max_state_bytes)
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

    async def push(self, session_id: str, samples: np.ndarray, sample_rate: int) -> list[str]:
        return await self.call("push", session_id, samples=samples, sample_rate=sample_rate)

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
                self.voicechat.model.prompt_cache = PromptCache(self.prompt_cache_bytes)
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
        """A silent stream, so compiled kernels exist before the first client."""
        started = time.perf_counter()
        logger.info("warming up (%d silent frames: compiles kernels on a first run)", frames)
        stream = self.voicechat.create_streaming_session()
        stream.push_audio(np.zeros(frames * stream.frame_samples, np.float32))
        stream.flush()
        _clear_cache()
        logger.info("warm-up done in %.1f s", time.perf_counter() - started)
        from ..loader import read_config
        from ..runtime import compile_policy

        path = getattr(self.voicechat.model, "model_path", None)
        if path is not None:  # later short CLI runs of this model may compile
            compile_policy.mark_warm(compile_policy.model_key(read_config(path)))

    def _serve(self) -> None:
        while True:
            commands = [self._next_command()]
            while True:  # everything queued so far is one turn
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if not self._turn(commands):
                break
            if self._jobs:  # a file advances at least once per turn
                self._jobs.step()
        self._jobs.fail_all(RuntimeError("the server is stopping"))
        if self.pool is not None:
            self.pool.close_all()

    def _next_command(self) -> _Command | None:
        """The next command; while transcription jobs wait, step them when none is queued."""
        while self._jobs:
            try:
                return self._commands.get_nowait()
            except queue.Empty:
                self._jobs.step()
        return self._commands.get()

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

    def _turn(self, commands: list[_Command | None]) -> bool:
        """Run one turn's commands in order, audio frames of distinct sessions as one step.

        Returns ``False`` at the stop sentinel.
        """
        frames: list[_Command] = []
        for command in commands:
            if command is None:
                self._step(frames)
                return False
            if command.kind == "push" and all(c.session_id != command.session_id for c in frames):
                frames.append(command)
                continue
            self._step(frames)  # per-session order: earlier frames first
            frames = [command] if command.kind == "push" else []
            if command.kind == "transcribe":
                self._add_job(command)
            elif command.kind == "open":
                self._add_open(command)
            elif command.kind != "push":
                self._run_command(command)
        self._step(frames)
        return True

    def _step(self, frames: list[_Command]) -> None:
        """One pool step over the given push commands; each gets its events or its error."""
        if not frames:
            return
        try:
            pool = self._loaded()
        except RuntimeError as exc:
            for command in frames:
                command.reply(error=exc)
            return
        known = [c for c in frames if c.session_id in pool]
        for command in frames:
            if command.session_id not in pool:
                command.reply(error=RuntimeError("realtime session is not active"))
        result = pool.step({c.session_id: (c.payload["samples"], c.payload["sample_rate"])
                            for c in known})
        self.metrics.step(result.frames, result.seconds, self.config.frame_duration)
        self.metrics.sessions(len(pool), pool.state_bytes)
        for command in known:
            error = result.errors.get(command.session_id)
            if error is not None:
                logger.debug("engine push failed for %s: %s", command.session_id, error,
                             exc_info=error)
                command.reply(error=error)
            else:
                command.reply(self._serializer(command.session_id)(
                    result.events[command.session_id]))

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
        factory = self.transcriber().create_stream if options.pop("text_only", False) \
            else None
        try:
            opening = pool.open_steps(session_id, factory=factory, **options)
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


def _clear_cache() -> None:
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # pragma: no cover - MLX missing its cache API
        logger.debug("mx.clear_cache failed", exc_info=True)
