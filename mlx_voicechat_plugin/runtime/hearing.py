"""The hearing half of a frame: every row's perception and the RNNT's tries, as one batch.

Rows are every stream that steps: conversations and transcript-only streams
(:class:`HearingRow`). Their hearing state (the encoder caches and
subsampling tails, the RNNT carries) is kept stacked between frames by a
:class:`HearingBatch`, the hearing half of a :class:`~.compute.Batch`.
:class:`Hearing` is one frame of the hearing half in flight. One row is a
batch of one through the same code.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..models.perception.perception_stream import PerceptionRows, PerceptionStream
from ..models.rnnt.rnnt import RNNTCarry, RNNTFrame, RNNTState
from ..models.rows import drop_row, stack_rows, take_rows
from .profile import FrameClock


class HearingRow:
    """A row of the hearing half: a ``perception`` source and an ``rnnt`` state (a
    :class:`ConversationState`, or a transcript-only stream's state).

    While a batch holds the row (:attr:`held`) its carried arrays are rows of the
    batch (its ``perception`` is ``None``, its ``rnnt`` keeps the books);
    ``StreamPool.extract`` gives them back before one session's state is read.
    """

    held = False  # its state is rows of a batch (set by the batch)
    perception: Any = None
    rnnt: RNNTState

    def check_own(self) -> None:
        """Its state is its own, not rows of a batch (which ``StreamPool.extract`` gives back)."""
        if self.held:
            raise RuntimeError("this session's state is rows of a pool's batch: read it "
                               "after StreamPool.extract(session_id)")

    @property
    def nbytes(self) -> int:
        """The bytes of its ``state`` (its own: a held row is sized by its batch)."""
        return sum(a.nbytes for a in self.state)


class HearingBatch:
    """The hearing state of a batch's rows, kept stacked between frames.

    While the same rows step in the same order (a pool's steady state), their
    encoder caches and mel tails stay stacked (one ``PerceptionRows``) and
    their RNNT carries one ``RNNTCarry``: a frame stacks and slices nothing.
    Rows that join are appended (:meth:`extend`); one that leaves takes its
    rows back (:meth:`remove`). One row is a batch of one through the same code.
    """

    def __init__(self, members: list[HearingRow]):
        """``members``: the batch's own list of its rows (kept by the batch, read here)."""
        self.members = members
        # None: sources that push on their own (whole signals, streams without the cache)
        self.perception: PerceptionRows | None = None
        self.decoded: list[int] = []  # the members whose RNNT runs: the carry's rows
        self.carry: RNNTCarry | None = None  # formed at the first frame (its dtype)

    def extend(self, states: list[HearingRow]) -> None:
        """Append ``states``' rows after the members' (before the batch appends them)."""
        sources = [s.perception for s in states]
        cached = all(isinstance(s, PerceptionStream) and s.use_cache for s in sources)
        if not self.members:
            self.perception = PerceptionRows.merge(sources) if cached and states else None
        elif cached and self.perception is not None:
            self.perception.extend(sources)
        elif self.perception is not None:  # a source that pushes alone: every row does
            for member, stream in zip(self.members, self.perception.split()):
                member.perception = stream
            self.perception = None
        if self.perception is not None:  # the rows are the batch's now
            for state in states:
                state.perception = None
        size = len(self.members)
        joining = [size + b for b, s in enumerate(states) if s.rnnt.enabled]
        if self.carry is not None and joining:
            self._hold([states[b - size].rnnt for b in joining], self.carry.arrays[0].dtype)
        self.decoded += joining

    def remove(self, row: int, state: HearingRow) -> list[mx.array]:
        """Row ``row``'s rows given back as ``state``'s own (copies; the batch took it out of
        its members); the others stay stacked. The arrays made."""
        perception, carry = self.perception, self.carry
        if perception is not None:
            state.perception = perception.remove(row)
            self.perception = perception if self.members else None
        if carry is not None and row in self.decoded:
            j = self.decoded.index(row)
            state.rnnt.carry = carry.extract(j)
            self.carry = (RNNTCarry([drop_row(a, j) for a in carry.arrays])
                          if carry.batch_size > 1 else None)
        self.decoded = [b - (b > row) for b in self.decoded if b != row]
        return [*state.perception.state, *state.rnnt.state,
                *(self.perception.state if self.perception is not None else []),
                *(self.carry.state if self.carry is not None else [])]

    def rnnt_carry(self, dtype: mx.Dtype) -> RNNTCarry:
        """The decoded rows' stacked carry (their own carries taken in at the first frame)."""
        if self.carry is None:
            self._hold([self.members[b].rnnt for b in self.decoded], dtype)
        return self.carry

    def _hold(self, rnnt: list[RNNTState], dtype: mx.Dtype) -> None:
        """Stack ``rnnt``'s carries after the held ones; they are held here, not theirs."""
        carries = [r.begin(dtype) for r in rnnt]
        for r in rnnt:
            r.carry = None
        self.carry = RNNTCarry.merge(carries if self.carry is None else [self.carry, *carries])

    def row_nbytes(self, row: int) -> int:
        """The bytes of a member's hearing state, read from its row."""
        state = self.members[row]
        perception = (self.perception.row_nbytes(row) if self.perception is not None
                      else sum(a.nbytes for a in state.perception.state))
        if self.carry is not None and row in self.decoded:
            return perception + self.carry.nbytes // len(self.decoded)
        return perception + state.rnnt.nbytes


class Hearing:
    """The hearing half of one frame of ``B`` rows, in flight.

    The rows' hearing state is ``batch``'s (:class:`HearingBatch`): the
    perception of every row, then the RNNT's first try of every row, queued
    for the frame's first evaluation (:attr:`arrays`); after it, :meth:`rest`
    queues the RNNT's other tries (after an emission) for the second, and
    :meth:`symbols` reads each row's symbols after that. One row is ``B = 1``.
    """

    def __init__(self, batch: HearingBatch, frames: list[Any], clock: FrameClock):
        self.batch = batch
        if batch.perception is not None:
            self.projected, self.encoded = batch.perception.push(frames, clock)
            self.arrays = [self.projected, self.encoded, *batch.perception.state]
        else:  # each source on its own: a whole signal's slice, a stream without the cache
            sources = [s.perception for s in batch.members]
            pairs = [source.push(frame) for source, frame in zip(sources, frames)]
            self.projected, self.encoded = (stack_rows(list(half)) for half in zip(*pairs))
            self.arrays = [self.projected, self.encoded, *(a for s in sources for a in s.state)]
        clock.stage("perception", *self.arrays)
        mx.async_eval(*self.arrays)
        # The RNNT's first try joins the first evaluation; a blank (most frames
        # of real speech) ends the frame's transcript work there.
        self.rnnt: RNNTFrame | None = None
        if batch.decoded:
            greedy = batch.members[batch.decoded[0]].rnnt.greedy
            self.rnnt = RNNTFrame(greedy, batch.rnnt_carry(self.encoded.dtype),
                                  take_rows(self.encoded, batch.decoded))
            self.arrays += self.rnnt.arrays

    def rest(self, clock: FrameClock) -> list[mx.array]:
        """After the first evaluation: the RNNT's other tries, queued (they start with the
        speaking half's evaluation, so a frame's evaluations do not depend on whether a
        row emitted); arrays to evaluate."""
        arrays = [] if self.rnnt is None else self.rnnt.rest()
        clock.stage("rnnt", *arrays)
        return arrays

    def symbols(self) -> list[list[int] | None]:
        """After the second evaluation: each row's RNNT symbols (host ints), or ``None``."""
        out: list[list[int] | None] = [None] * len(self.batch.members)
        if self.rnnt is not None:
            for b, symbols in zip(self.batch.decoded, self.rnnt.symbols()):
                out[b] = symbols
        return out
