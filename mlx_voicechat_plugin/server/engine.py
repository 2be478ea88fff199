"""The engine thread: the only thread that touches MLX.

Socket tasks send ``open``/``push``/``flush``/``cancel``/``close`` commands over
a queue (``submit`` queues one at once) and await a one-shot reply (an asyncio future the engine resolves via
``loop.call_soon_threadsafe``). Events come back already serialized to JSON
text, base64 audio included, so the event loop only forwards strings. The
engine holds at most one streaming session; a reservation keeps a second
connection from starting one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..runtime.events import Audio, Cancelled
from ..runtime.prompt_cache import PromptCache
from . import protocol

logger = logging.getLogger(__name__)

# Enough frames for the encoder's attention windows to fill on the released
# checkpoint (70 frames of left context), so the steady shapes are compiled too.
WARM_UP_FRAMES = 80

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
    """One long-lived worker thread owning the model and the streaming session."""

    def __init__(self, model_path: str, loader: Loader | None = None,
                 prompt_cache_bytes: int | None = None, warm_up: bool = False):
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
        self._reserved: str | None = None
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

    # --- the one-session reservation -----------------------------------

    def try_reserve(self, session_id: str) -> bool:
        with self._reservation:
            if self._reserved is not None:
                return False
            self._reserved = session_id
            return True

    def release(self, session_id: str) -> None:
        with self._reservation:
            if self._reserved == session_id:
                self._reserved = None

    @property
    def busy(self) -> bool:
        return self._reserved is not None

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
        sent; it runs on this thread (default :func:`serialize_vlm`).
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

    # --- the thread -----------------------------------------------------

    def _run(self) -> None:
        try:
            logger.info("loading %s", self.model_path)
            self.voicechat = self.loader(self.model_path)
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
        session_id: str | None = None
        stream: Any = None
        serialize: Serializer = serialize_vlm
        while True:
            command = self._commands.get()
            if command is None:
                break
            try:
                if self.voicechat is None:
                    raise RuntimeError(f"model failed to load: {self.load_error}")
                if command.kind == "open":
                    if stream is not None:
                        raise RuntimeError("a realtime session is already active")
                    options = dict(command.payload)
                    serializer = options.pop("serializer", None) or serialize_vlm
                    try:
                        stream = self.voicechat.create_streaming_session(**options)
                    except BaseException:
                        _clear_cache()  # what a stopped or failed prefill allocated
                        raise
                    finally:
                        self._aborts.pop(command.session_id, None)
                    session_id, serialize = command.session_id, serializer
                    value: Any = {
                        "input_sample_rate": stream.sample_rate,
                        "output_sample_rate": self.config.output_sample_rate,
                        "frame_samples": stream.frame_samples,
                        "max_streaming_seconds": stream.options.max_streaming_seconds,
                    }
                elif command.kind == "close":
                    if stream is not None and session_id == command.session_id:
                        if not stream.closed:
                            stream.cancel()
                        stream, session_id = None, None
                        _clear_cache()
                    value = None
                else:
                    if stream is None or session_id != command.session_id:
                        raise RuntimeError("realtime session is not active")
                    if command.kind == "push":
                        events = stream.push_audio(command.payload["samples"],
                                                   sample_rate=command.payload["sample_rate"])
                    elif command.kind == "flush":
                        before = stream.frame_index
                        events = stream.flush(pad_partial=command.payload["pad_partial"])
                        # Events of frames run before the commit (the last such
                        # frame's audio) go out before ``committed``.
                        lead = 0
                        while lead < len(events) and events[lead].frame_index < before \
                                and isinstance(events[lead], Audio):
                            lead += 1
                    elif command.kind == "cancel":
                        # A client that cancels always hears response.cancelled,
                        # also after a failed commit closed the stream.
                        events = stream.cancel() or [Cancelled(stream.frame_index)]
                    elif command.kind == "tool_result":
                        stream.submit_tool_result(command.payload["call_id"],
                                                  command.payload["output"])
                        events = []
                    else:
                        raise ValueError(f"unknown engine command {command.kind!r}")
                    if command.kind == "flush":
                        value = (serialize(events[:lead]), serialize(events[lead:]))
                    else:
                        value = serialize(events)
            except Exception as exc:
                # Reported to the client, and logged once there (send_error).
                logger.debug("engine %s failed for %s: %s", command.kind,
                             command.session_id, exc, exc_info=True)
                command.reply(error=exc)
            else:
                command.reply(value)
        if stream is not None and not stream.closed:
            stream.cancel()


def _clear_cache() -> None:
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # pragma: no cover - MLX missing its cache API
        logger.debug("mx.clear_cache failed", exc_info=True)
