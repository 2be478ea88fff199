"""Many conversations on one loaded model: sessions leased from a bounded pool, stepped together.

:class:`StreamPool` is the in-process API (the server's engine thread, the
tests and the benchmarks use it): ``open`` a session under an id, ``step``
every session that has a frame ready by one frame, ``flush`` / ``cancel`` /
``close`` it. Admission is bounded by the number of open sessions and by
their reservations (:mod:`.reservation`: each session's worst-case state,
computed from the config when it opens, before its prefill), which the
measured bytes of their state arrays (:attr:`state_bytes`, summed from each
session's :meth:`~StreamPool.nbytes`: at each change of membership, and after steps when read)
never pass; a refused ``open`` raises
:class:`PoolFull`, and a closed session's slot, reservation and state are
free at once.

Fairness: one ``step`` advances each given session by at most one frame, so
a client that sends faster than real time cannot take a second frame while
another waits; a session with no frame ready costs nothing. Failure
isolation: a session whose frame raises is reported (its exception in the
step's result) and the others' frames still run.

A session is a streaming shell over a full conversation (opened with
:class:`~.options.ConversationOptions`) or over perception and the RNNT only (a
transcript-only stream, :class:`~.options.TranscriptionOptions`). A step runs
its sessions' frames as one batched frame (:func:`~.streaming.step_cores`:
every session's hearing half, perception and the RNNT, in one batch, the
speaking half for the conversations; stages whose rows are independent take
every session at once), so every session's ids, codes, samples and transcript
equal those of that session run alone. The pool holds one
:class:`~.compute.Batch`, the stepping sessions' state as rows: ``step``
decides its members once (those that leave extracted, those that join
appended), and reading one session's state is a call on the pool
(:meth:`~StreamPool.extract`, :meth:`~StreamPool.nbytes`) that copies or
sizes that session's rows only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Generator

import numpy as np

from .events import Event
from .compute import Batch
from .ledger import ReservationLedger
from .options import ConversationOptions, TranscriptionOptions
from .reservation import Reservations
from .streaming import StreamingShell, step_cores
from .timeline import PrefillCancelled


class PoolFull(RuntimeError):
    """No slot (``max_sessions``) or no state budget (``max_state_bytes``) is left."""


@dataclass
class StepResult:
    """One :meth:`StreamPool.step`: each session's events or its exception, and timing."""

    events: dict[str, list[Event]] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)
    frames: int = 0  # frames the sessions ran (a chunk shorter than a frame runs none)
    seconds: float = 0.0

    @property
    def size(self) -> int:
        return len(self.events) + len(self.errors)


class StreamPool:
    """Streaming sessions of one :class:`~.voicechat.VoiceChat`, by id, within budgets."""

    def __init__(self, voicechat: Any, max_sessions: int = 1,
                 max_state_bytes: int | None = None,
                 default_options: ConversationOptions | None = None,
                 ledger: ReservationLedger | None = None):
        """``default_options``: what a session gets when its client asks for nothing (the
        server's bounds), the least a new session reserves at admission. ``ledger``: where
        the reservations are kept (a server's admission reads the same one)."""
        self.ledger = ledger or ReservationLedger()
        self.ledger.bound(max_sessions, max_state_bytes)  # admission's bounds are the pool's
        self.default_options = default_options or ConversationOptions()
        self.voicechat = voicechat
        self.sessions: dict[str, StreamingShell] = {}
        self.batch = Batch()  # the stepping sessions' state, stacked while the same ones step
        # Measured at every change of membership; a step only marks it stale (it changes
        # every stepped session's state, and sizing them all is host work per row).
        self._state_bytes = 0
        self._stale = False
        self.reservations = Reservations(voicechat)
        self.reserved = self.ledger.reserved  # session -> its worst-case state bytes
        # The smallest reservation a new conversation can have (no prompt, default options):
        # what admission before the options are known asks for. Computed now, not at the
        # first open (nor on another thread).
        self.ledger.least = (0 if max_state_bytes is None
                             else self.reservations.of(self.default_options, 0))

    def __len__(self) -> int:
        return len(self.sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.sessions

    @property
    def reserved_bytes(self) -> int:
        """What the open sessions reserve in all (read from any thread)."""
        return self.ledger.reserved_bytes

    @property
    def state_bytes(self) -> int:
        """The measured bytes of the open sessions' state, sized now if a step ran since
        (read on the thread that steps; other threads read the ledger's copy)."""
        if self._stale:
            self._measure()
        return self._state_bytes

    def _measure(self) -> None:
        self._stale = False
        self._state_bytes = self.ledger.state_bytes = sum(map(self.nbytes, self.sessions))

    def nbytes(self, session_id: str) -> int:
        """The bytes of a session's state arrays (caches, carries), read from its rows in
        place while the batch holds them (a pool's stream holds no framer: its caller
        frames the audio)."""
        return self.batch.nbytes(self.get(session_id).core.compute)

    # --- lifecycle ----------------------------------------------------------

    def open(self, session_id: str,
             options: ConversationOptions | TranscriptionOptions | None = None) -> StreamingShell:
        """A new session under ``session_id`` (its prompt prefilled); :class:`PoolFull` if none fits.

        ``options``: :class:`ConversationOptions` (the default) opens a full
        conversation, :class:`TranscriptionOptions` a transcript-only stream.
        """
        for _ in self.open_steps(session_id, options):
            pass
        return self.sessions[session_id]

    def open_steps(self, session_id: str,
                   options: ConversationOptions | TranscriptionOptions | None = None
                   ) -> Generator[int, None, StreamingShell]:
        """:meth:`open` with the prompt prefill one position per step (yields the
        positions left; returns the session), so a caller can run other sessions'
        frames between the positions. The slot is held from the first step; a
        prefill that fails or is stopped frees it."""
        if options is None:
            options = ConversationOptions()
        if not isinstance(options, (ConversationOptions, TranscriptionOptions)):
            raise TypeError(f"options must be ConversationOptions or TranscriptionOptions, "
                            f"got {type(options).__name__}")
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        reason = self.ledger.refusal(len(self.sessions), self.reserved_bytes)
        if reason is not None:  # one more session would be refused now
            raise PoolFull(reason)
        if isinstance(options, ConversationOptions):
            stream = self.voicechat.create_streaming_session(options=options, defer_start=True,
                                                             framed_by_caller=True)
        else:
            stream = self.voicechat.create_transcription_stream(options=options,
                                                                framed_by_caller=True)
        self.sessions[session_id] = stream
        try:
            self._reserve(session_id, stream, options)
            for left in stream.start_steps():
                if self.sessions.get(session_id) is not stream:
                    raise PrefillCancelled("the session was closed during its prefill")
                yield left
        except BaseException:
            if self.sessions.get(session_id) is stream:
                self.close(session_id)
            raise
        self._measure()
        return stream

    def _reserve(self, session_id: str, stream: StreamingShell,
                 options: ConversationOptions | TranscriptionOptions) -> None:
        """Reserve the new session's worst-case state (its prompt is known now, before
        its prefill); :class:`PoolFull` when it does not fit the budget."""
        if self.ledger.max_state_bytes is None:
            return
        # A transcript-only stream: perception and the RNNT, part of a conversation's fixed state.
        need = (self.reservations.of(options, stream.core.shape.prompt)
                if isinstance(options, ConversationOptions) else self.reservations.fixed_bytes())
        reason = self.ledger.refusal(len(self.sessions) - 1, self.reserved_bytes, need)
        if reason is not None:  # the others' slots and reservations, and its own
            raise PoolFull(reason)
        self.reserved[session_id] = need

    def get(self, session_id: str) -> StreamingShell:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise KeyError(f"session {session_id!r} is not open") from None

    def close(self, session_id: str) -> None:
        """Cancel the session if it is still running and free its slot and state."""
        stream = self.sessions.pop(session_id, None)
        self.reserved.pop(session_id, None)
        if stream is not None and not stream.closed:
            self.batch.extract(stream.core.compute)
            stream.cancel()
        self._measure()

    def close_all(self) -> None:
        for session_id in list(self.sessions):
            self.close(session_id)

    # --- frames ---------------------------------------------------------------

    def step(self, frames: dict[str, np.ndarray]) -> StepResult:
        """Advance each session in ``frames`` (id -> one native frame of PCM) by that frame.

        The sessions' frames run as one batched frame of all of them
        (:func:`~.streaming.step_cores`); the caller cuts the frames (the
        server's session channels do). A session that has ended, reached its
        length limit or whose books failed has its exception in ``errors``;
        the others go on.
        """
        result = StepResult()
        started = time.perf_counter()
        ready = []
        for session_id, frame in frames.items():
            try:
                stream = self.get(session_id)
                if getattr(frame, "shape", None) != (stream.frame_samples,):
                    raise ValueError(f"a step takes one frame of {stream.frame_samples} "
                                     f"samples a session, got {getattr(frame, 'shape', frame)!r}")
                stream.check_frame()
            except Exception as exc:  # this session only
                result.errors[session_id] = exc
            else:
                ready.append(session_id)
        if ready:  # the batch's members that step first, in their order; then the others
            order = {id(m): b for b, m in enumerate(self.batch.members)}
            ready.sort(key=lambda k: order.get(id(self.sessions[k].core.compute), len(order)))
            cores = [self.sessions[k].core for k in ready]
            states = [c.compute for c in cores]
            if states != self.batch.members:  # membership decided here, once a step
                self.batch.update(states)
            outcomes = step_cores(cores, [frames[k] for k in ready], self.batch)
            result.frames = len(ready)
            for session_id, outcome in zip(ready, outcomes):
                if isinstance(outcome, Exception):
                    result.errors[session_id] = outcome
                else:
                    result.events[session_id] = outcome
        result.seconds = time.perf_counter() - started
        self._stale = True  # sized when read (state_bytes), not after every step
        return result

    def extract(self, session_id: str) -> StreamingShell:
        """The session with its state out of the pool's batch as its own (copies of its
        rows only; the others stay stacked): what reading its state alone needs (a
        snapshot, ``state``). It joins again at its next step."""
        stream = self.get(session_id)
        self.batch.extract(stream.core.compute)
        return stream

    def flush(self, session_id: str, pad_partial: bool = True,
              partial: np.ndarray | None = None) -> list[Event]:
        """End the session's input; ``partial``: the PCM short of a frame its caller held."""
        try:
            return self.extract(session_id).flush(pad_partial, partial)
        finally:
            self._measure()

    def cancel(self, session_id: str) -> list[Event]:
        try:
            return self.extract(session_id).cancel()
        finally:
            self._measure()
