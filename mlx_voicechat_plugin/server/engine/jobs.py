"""Engine jobs: long work stepped on the engine thread between commands and frames.

A job is a generator the engine advances one step at a time, round robin,
after every turn of commands and whenever none waits: a file transcription
(:meth:`Transcriber.steps`: 25 streaming frames of the file, perception and
RNNT, at a time) or a session open (its prompt prefill in slices). So realtime
sessions' frames are never queued behind a whole file or prompt, and a job
still advances while sessions keep the queue busy.
A step's yielded items (a transcription's deltas) go to the job's
``on_step`` (called on the engine thread; it posts to the event loop). The
count of file transcriptions admitted and not yet finished is bounded by the
caller (:meth:`JobCounter.try_admit`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

logger = logging.getLogger(__name__)


class JobCounter:
    """File transcriptions admitted and not yet finished, bounded (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_flight = 0

    def try_admit(self, limit: int) -> bool:
        with self._lock:
            if self.in_flight >= limit:
                return False
            self.in_flight += 1
            return True

    def ended(self) -> None:
        """One admitted transcription ended (however it ended)."""
        with self._lock:
            self.in_flight = max(self.in_flight - 1, 0)


@dataclass
class StepJob:
    """One job's steps; ``reply`` resolves the caller's future (value or error)."""

    steps: Generator[list[Any], None, Any]
    reply: Callable[..., None]
    on_step: Callable[[list[Any]], None] | None = None  # a step's non-empty yield
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: Callable[[], None] = lambda: None  # runs first when the job ends


class JobQueue:
    """The engine's pending jobs, oldest first (engine thread only)."""

    def __init__(self) -> None:
        self._jobs: deque[StepJob] = deque()

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: StepJob) -> None:
        self._jobs.append(job)

    def step(self) -> None:
        """Advance the next job by one step (round robin, so a long file does not hold
        up a session's prefill); finish it when it ends, fails or is cancelled."""
        self._jobs.rotate(-1)
        job = self._jobs[0]
        try:
            if job.cancelled.is_set():
                job.steps.close()
                raise RuntimeError("the job was cancelled")
            items = next(job.steps)
            if items and job.on_step is not None:
                job.on_step(items)
        except StopIteration as finished:
            self._finish(job, value=finished.value)
        except Exception as exc:
            logger.debug("engine job failed: %s", exc, exc_info=True)
            self._finish(job, error=exc)

    def fail_all(self, error: BaseException) -> None:
        while self._jobs:
            job = self._jobs[0]
            job.steps.close()
            self._finish(job, error=error)

    def _finish(self, job: StepJob, value: Any = None,
                error: BaseException | None = None) -> None:
        self._jobs.popleft()
        # The slot is free before the reply leaves, so a client that sends
        # its next request on the reply is admitted.
        job.done()
        try:
            job.reply(value, error=error)
        except Exception:  # never take the engine thread down with one job
            logger.exception("replying to a finished engine job failed")
