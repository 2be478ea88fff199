"""The listening half of a frame: every row's perception and the RNNT's tries, as one batch.

Rows are every stream that steps: conversations and transcript-only streams
(:class:`ListeningRow`). Their listening state (the encoder caches and
subsampling tails, the RNNT carries) is kept stacked between frames by a
:class:`HearingBatch` (a pool owns one), the same way
:class:`~.compute.TimelineBatch` keeps the conversations' timelines: while
the same rows step in the same order nothing is stacked or sliced; a change
of membership, or one row's state read on its own, gives every row its state
back. :class:`Hearing` is one frame of the listening half in flight. One row
is a batch of one through the same code.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..models.perception_stream import PerceptionRows, PerceptionStream
from ..models.rnnt import RNNTCarry, RNNTFrame, RNNTState
from ..models.rows import stack_rows, take_rows
from .profile import FrameClock


class HeldPart:
    """A member's own part of its state (``_<name>``) that a batch may hold as a row
    (the batch named by ``batch``): reading or replacing it gives every row of that
    batch back first, so what is read is the member's own, current state."""

    def __init__(self, batch: str, doc: str = ""):
        self.batch, self.__doc__ = batch, doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.own = "_" + name

    def __get__(self, member: Any, owner: type | None = None) -> Any:
        if member is None:
            return self
        held = getattr(member, self.batch)
        if held is not None:
            held.dissolve()
        return getattr(member, self.own)

    def __set__(self, member: Any, value: Any) -> None:
        held = getattr(member, self.batch)
        if held is not None:
            held.dissolve()
        setattr(member, self.own, value)


class ListeningRow:
    """A row of the listening half: a ``perception`` source and an ``rnnt`` state (a
    :class:`ConversationState`, or a transcript-only stream's state).

    While the row steps in a :class:`HearingBatch` its carried arrays (the
    encoder cache, the RNNT carry) are rows of the batch's stacked state: reading
    its ``perception`` gives every row of that batch back first; ``rnnt`` stays
    the row's own (its transcript is host books), its ``carry`` the batch's
    until then.
    """

    hearing: "HearingBatch | None" = None  # the batch holding its listening state, if one does
    hearing_row = 0  # its row there
    _perception: Any = None
    rnnt: RNNTState

    perception = HeldPart("hearing", "Its own perception source (a batch holding its row "
                          "gives every row back first).")

    def listening_nbytes(self) -> int:
        """The bytes of its perception state and RNNT carry (a held row's read from its
        batch without taking it out)."""
        if self.hearing is not None:
            return self.hearing.row_nbytes(self.hearing_row)
        source = self._perception
        perception = 0 if source is None else (
            getattr(source, "nbytes", None) or sum(a.nbytes for a in source.state))
        return perception + self.rnnt.nbytes


class HearingBatch:
    """The listening state of the rows that step together, kept stacked between frames.

    While the same rows step in the same order (a pool's steady state), their
    encoder caches and mel tails stay stacked (one ``PerceptionRows``) and
    their RNNT carries one ``RNNTCarry``: a frame stacks and slices nothing.
    The batch changes only when its membership does (:meth:`join` with other
    rows: a session joins, leaves, pauses or is starved),
    or when one member's state is read on its own (its ``perception``: a
    snapshot, a release): then every row goes back to its owner
    (:meth:`dissolve`). A member's bytes are read from its row without taking it
    out. One row is a batch of one through the same code (merging and giving
    back one row move no data).
    """

    def __init__(self) -> None:
        self.members: list[ListeningRow] = []
        # None: sources that push on their own (whole signals, streams without the cache)
        self.perception: PerceptionRows | None = None
        self.decoded: list[int] = []  # the members whose RNNT runs: the carry's rows
        self.carry: RNNTCarry | None = None  # formed at the first frame (its dtype)
        self.returned: list[ListeningRow] = []  # given back since it last formed

    def join(self, states: list[ListeningRow]) -> "HearingBatch":
        """This batch holding ``states``' rows, in order (as it is while they are its members)."""
        if self.members and len(states) == len(self.members) and all(
                a is b for a, b in zip(states, self.members)):
            return self
        left = [m for m in self.members or self.returned if all(m is not s for s in states)]
        self.dissolve()
        for state in states:  # rows another batch holds go back to their owners
            if state.hearing is not None:
                state.hearing.dissolve()
        # Rows that left make their copies (rows.own_row) now, so none keeps the batch's
        # buffers alive while it does not step; those that step on, within their frame.
        arrays = [a for s in left if s.hearing is None and s._perception is not None
                  for a in (*s._perception.state, *s.rnnt.state)]
        if arrays:
            mx.eval(arrays)
        self.returned = []
        sources = [s._perception for s in states]
        if all(isinstance(s, PerceptionStream) and s.use_cache for s in sources):
            self.perception = PerceptionRows.merge(sources)
        self.decoded = [b for b, s in enumerate(states) if s.rnnt.enabled]
        self.members = list(states)
        for row, state in enumerate(states):
            state.hearing, state.hearing_row = self, row
        return self

    def rnnt_carry(self, dtype: mx.Dtype) -> RNNTCarry:
        """The decoded rows' stacked carry (their own carries taken in at the first frame)."""
        if self.carry is None:
            rnnt = [self.members[b].rnnt for b in self.decoded]
            self.carry = RNNTCarry.merge([r.begin(dtype) for r in rnnt])
            for r in rnnt:
                r.carry = None  # held here
        return self.carry

    def row_nbytes(self, row: int) -> int:
        """The bytes of a member's listening state, read from its row."""
        state = self.members[row]
        perception = (self.perception.row_nbytes(row) if self.perception is not None
                      else sum(a.nbytes for a in state._perception.state))
        if self.carry is not None and row in self.decoded:
            return perception + self.carry.nbytes // len(self.decoded)
        return perception + state.rnnt.nbytes

    def dissolve(self) -> None:
        """Every member takes its rows back as its own state."""
        members, perception, carry = self.members, self.perception, self.carry
        self.members, self.perception, self.carry = [], None, None
        self.returned = members or self.returned
        for state in members:
            state.hearing = None
        if perception is not None:
            perception.split()
        if carry is not None:
            for j, b in enumerate(self.decoded):
                members[b].rnnt.carry = carry.extract(j)


class Hearing:
    """The listening half of one frame of ``B`` rows, in flight.

    The rows' listening state is ``batch``'s (:class:`HearingBatch`): the
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
            sources = [s._perception for s in batch.members]
            pairs = [source.push(frame) for source, frame in zip(sources, frames)]
            self.projected = stack_rows([p for p, _ in pairs])
            self.encoded = stack_rows([e for _, e in pairs])
            self.arrays = [self.projected, self.encoded, *(a for s in sources for a in s.state)]
        clock.stage("perception", *self.arrays)
        mx.async_eval(*self.arrays)
        # The RNNT's first try joins the first evaluation; a blank (most frames
        # of real speech) ends the frame's transcript work there.
        self.rnnt: RNNTFrame | None = None
        if batch.decoded:
            greedy = batch.members[batch.decoded[0]].rnnt.greedy
            assert greedy is not None
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
