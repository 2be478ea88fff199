"""File transcriptions as engine jobs: stepped on the engine thread between commands.

A job is :meth:`Transcriber.steps` over one uploaded file. The engine runs one
step of the oldest job (the file's perception, then 25 RNNT frames at a time)
after every turn of commands and whenever none waits, so realtime sessions'
frames are never queued behind a whole file, and a file still advances while
sessions keep the queue busy.
Each step's transcript deltas go to the job's ``on_delta`` (called on the
engine thread; it posts to the event loop). The count of jobs admitted and
not yet finished is bounded by the caller (:meth:`JobCounter.try_admit`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

logger = logging.getLogger(__name__)

DeltaSink = Callable[[list[str]], None]


class JobCounter:
    """Transcriptions admitted and not yet finished, bounded (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_flight = 0

    def try_admit(self, limit: int) -> bool:
        with self._lock:
            if self.in_flight >= limit:
                return False
            self.in_flight += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.in_flight = max(self.in_flight - 1, 0)


@dataclass
class TranscriptionJob:
    """One file's steps; ``reply`` resolves the caller's future (value or error)."""

    steps: Generator[list[Any], None, Any]
    reply: Callable[..., None]
    on_delta: DeltaSink | None = None
    serialise: Callable[[Any], str] = str
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: Callable[[], None] = lambda: None


class JobQueue:
    """The engine's pending transcription jobs, oldest first (engine thread only)."""

    def __init__(self) -> None:
        self._jobs: deque[TranscriptionJob] = deque()

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: TranscriptionJob) -> None:
        self._jobs.append(job)

    def step(self) -> None:
        """Advance the next job by one step (round robin, so a long file does not hold
        up a session's prefill); finish it when it ends, fails or is cancelled."""
        self._jobs.rotate(-1)
        job = self._jobs[0]
        try:
            if job.cancelled.is_set():
                job.steps.close()
                raise RuntimeError("transcription cancelled")
            deltas = next(job.steps)
            if deltas and job.on_delta is not None:
                job.on_delta([job.serialise(d) for d in deltas])
        except StopIteration as finished:
            self._finish(job, value=finished.value)
        except Exception as exc:
            logger.debug("transcription failed: %s", exc, exc_info=True)
            self._finish(job, error=exc)

    def fail_all(self, error: BaseException) -> None:
        while self._jobs:
            job = self._jobs[0]
            job.steps.close()
            self._finish(job, error=error)

    def _finish(self, job: TranscriptionJob, value: Any = None,
                error: BaseException | None = None) -> None:
        self._jobs.popleft()
        # The slot is free before the reply leaves, so a client that sends
        # its next request on the reply is admitted.
        job.done()
        try:
            job.reply(value, error=error)
        except Exception:  # never take the engine thread down with one job
            logger.exception("replying to a finished transcription failed")
