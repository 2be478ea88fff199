"""The sessions' input queues on the engine thread: PCM chunks in, batched pool steps out.

A connection's PCM (an :class:`~.commands.Append`, or an awaited
:class:`~.commands.Push`) joins its session's :class:`~.scheduler.SessionInput`;
ordered commands (flush, cancel, a tool result, a barrier) wait behind it.
:meth:`InputStepper.step` cuts native frames and runs one pool step over
the sessions with a frame ready (when :class:`~.scheduler.BatchScheduler`
says so), each frame's events translated by the session's dialect and sent
to the connection that queued them; :meth:`InputStepper.run_heads` hands a
command reaching the head of its queue back to the engine, after the
partial frame before it has gone to the stream.

The PCM is at the session's input rate (its dialect checks or converts the
client's); the stream checks the rest (that it is open, the samples) when the
frame runs, and the pool's step reports a failure for that session only: it
fails the append the frame came from.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from ..runtime.audio import as_pcm_chunk
from ..runtime.pool import SessionPool
from .commands import Append, Command, Push, Translator
from .metrics import EngineMetrics
from .scheduler import BatchScheduler, Chunk, SessionInput

logger = logging.getLogger(__name__)

NOT_ACTIVE = "realtime session is not active"
Deliver = Callable[[Any, list], None]  # (feed, a frame's texts) -> the connection


class InputStepper:
    """Every session's input queue and translator (engine thread only)."""

    def __init__(self, metrics: EngineMetrics, deliver: Deliver):
        self.metrics = metrics
        self.deliver = deliver
        self.pool: SessionPool | None = None  # set once the model is loaded
        self.scheduler: BatchScheduler | None = None  # set when the engine starts serving
        self.inputs: dict[str, SessionInput] = {}
        self.translators: dict[str, Translator] = {}  # session -> its dialect's
        self.peak_bytes = 0  # the most PCM one session's queue ever held

    # --- what is due --------------------------------------------------------------

    def commands_due(self) -> bool:
        return any(i.head_command() is not None for i in self.inputs.values())

    def wait(self) -> float | None:
        """Seconds until the next step is due (0: now), ``None`` when no frame is ready."""
        return self.scheduler.wait(self.inputs, time.perf_counter())

    def queue(self, command: Command) -> bool:
        """Queue an ordered command behind its session's audio; ``False`` when none waits."""
        if not command.ordered:
            return False
        queue_ = self.inputs.get(command.session_id)
        if queue_ is None or not queue_.items:
            return False
        queue_.add_command(command)
        return True

    # --- audio in -------------------------------------------------------------------

    def add(self, command: Append | Push) -> None:
        """A chunk of PCM for a session's queue (framed later; the session must be open)."""
        session_id, pool = command.session_id, self.pool
        feed = command.feed if isinstance(command, Append) else None
        tag = command.tag if isinstance(command, Append) else object()
        chunk = Chunk(command.samples, tag, feed, command if feed is None else None)
        try:
            if pool is None or session_id not in pool:
                raise RuntimeError(NOT_ACTIVE)
            stream = pool.get(session_id)
            chunk.samples = as_pcm_chunk(command.samples)
        except Exception as exc:
            self.consumed([(feed, _length(command.samples))])
            self.fail(chunk, exc)
            return
        queue_ = self.inputs.get(session_id)
        if queue_ is None:
            queue_ = self.inputs[session_id] = SessionInput(stream.frame_samples,
                                                            stream.sample_rate)
        queue_.add_chunk(chunk, time.perf_counter())
        self.peak_bytes = max(self.peak_bytes, queue_.nbytes)
        self.answer_settled(queue_)

    def run_heads(self, run: Callable[[Command], None]) -> None:
        """Run (with ``run``) the commands that reached the head of their session's queue."""
        for session_id, queue_ in list(self.inputs.items()):
            while (command := queue_.head_command()) is not None:
                if queue_.items[0] is not command:  # a partial frame first: the stream keeps it
                    samples, consumed, finished = queue_.take_residual()
                    self.stage(session_id, samples, finished)
                    self.consumed(consumed)
                queue_.pop_command(time.perf_counter())
                run(command)

    def stage(self, session_id: str, samples: np.ndarray, finished: list[Chunk]) -> None:
        """Hand a partial frame to the session's stream (it runs no frame)."""
        result = self.pool.step({session_id: (samples, self.inputs[session_id].rate)})
        error = result.errors.get(session_id)
        if error is not None and finished:
            self.fail(finished[-1], error)
        for chunk in finished:
            answer(chunk)

    # --- frames out -----------------------------------------------------------------

    def step(self) -> None:
        """One pool step: a frame of every session that has one ready."""
        pool, scheduler, config = self.pool, self.scheduler, self.pool.voicechat.config
        ready = scheduler.ready(self.inputs)
        now = started = time.perf_counter()
        waited = now - scheduler.collection_start(self.inputs, ready)
        frames = {k: self.inputs[k].take_frame(now) for k in ready}
        result = pool.step({k: (f.samples, self.inputs[k].rate) for k, f in frames.items()})
        self.metrics.step(result.frames, result.seconds, config.frame_duration)
        self.metrics.collected(waited)
        for session_id, frame in frames.items():
            queue_ = self.inputs[session_id]
            error = result.errors.get(session_id)
            if error is not None:
                logger.debug("engine frame failed for %s: %s", session_id, error, exc_info=error)
                consumed, _ = queue_.drop_tag(frame.owner.tag, time.perf_counter())
                frame.consumed += consumed
                self.fail(frame.owner, error)
            else:
                texts = self.translators[session_id].translate(result.events[session_id])
                if frame.owner.reply is not None:
                    frame.owner.events += texts
                elif frame.owner.feed is not None and texts:
                    self.deliver(frame.owner.feed, texts)
            for chunk in frame.finished:
                answer(chunk)
            self.answer_settled(queue_)
            self.consumed(frame.consumed)
        self.metrics.sessions(len(pool), pool.state_bytes)
        self.metrics.buffered(sum(q.buffered for q in self.inputs.values())
                              / config.input_sample_rate)
        scheduler.free_since = time.perf_counter()
        scheduler.record(result.frames, scheduler.free_since - started)

    def answer_settled(self, queue_: SessionInput) -> None:
        for chunk in list(queue_.settled()):
            answer(chunk)

    @staticmethod
    def fail(chunk: Chunk, error: BaseException) -> None:
        if chunk.reply is not None:
            chunk.reply.reply(error=error)
            chunk.reply = None
        elif chunk.feed is not None:
            notify(chunk.feed, "failed", error)

    @staticmethod
    def consumed(consumed: list[tuple[Any, int]]) -> None:
        """Tell each feed how many of its samples left the queue (its room for more)."""
        totals: dict[int, tuple[Any, int]] = {}
        for feed, samples in consumed:
            if feed is not None and samples:
                totals[id(feed)] = (feed, totals.get(id(feed), (feed, 0))[1] + samples)
        for feed, samples in totals.values():
            notify(feed, "consumed", samples)

    # --- closing ----------------------------------------------------------------------

    def drop(self, session_id: str) -> None:
        """Forget a closing session's queue; what waits in it is answered with an error."""
        queue_ = self.inputs.pop(session_id, None)
        if queue_ is None:
            return
        gone = RuntimeError(NOT_ACTIVE)
        for item in queue_.drain():
            if isinstance(item, Chunk):
                self.consumed([(item.feed, item.left)])
                if item.reply is not None:
                    item.reply.reply(error=gone)
            else:
                item.reply(error=gone)

    def drop_all(self) -> None:
        for session_id in list(self.inputs):
            self.drop(session_id)


def answer(chunk: Chunk) -> None:
    """Reply to a push with the events of the frames it completed."""
    if chunk.reply is not None:
        chunk.reply.reply(chunk.events)
        chunk.reply = None


def notify(feed: Any, method: str, value: Any) -> None:
    """Call ``feed.method(value)`` on the feed's event loop, in order."""
    try:
        feed.loop.call_soon_threadsafe(getattr(feed, method), value)
    except RuntimeError:  # the loop has closed
        pass


def _length(samples: Any) -> int:
    shape = getattr(samples, "shape", None)
    return int(shape[0]) if shape else 0
