"""What a batch holds for its members between frames: :class:`HeldBatch`.

A pool keeps the state of the rows that step together stacked between
frames, one batch per half of the frame (:class:`~.compute.TimelineBatch`,
the timelines and codec streams; :class:`~.hearing.HearingBatch`, the
listening state); while a member steps its state exists only as rows there.
While the same members step in the same order a frame stacks and slices
nothing. When the members change (:meth:`HeldBatch.join`) a member that left
takes its rows back as copies (:meth:`HeldBatch.remove`: mlx-lm's
``extract`` and ``filter``), one that joins is appended (``extend``), and
those that stay are not moved. Reading one member's state alone is that
member's :meth:`~HeldBatch.remove` (``StreamPool.extract``). One row is a
batch of one through the same code (its rows move no data).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx


class HeldBatch:
    """The states of the members that step together, kept stacked between frames.

    A subclass names the members' attribute that points at the batch holding
    them (:attr:`slot`; the member's row there is ``<slot>_row``), appends
    members' rows (:meth:`_extend`, mlx-lm's ``extend``) and gives one member's
    rows back as copies, keeping the others (:meth:`_remove`: ``extract`` and
    ``filter``).
    """

    slot = "batch"

    def __init__(self) -> None:
        self.members: list[Any] = []

    def holds(self, states: Sequence[Any]) -> bool:
        """Its members are ``states``, in order."""
        return bool(self.members) and len(states) == len(self.members) and all(
            a is b for a, b in zip(states, self.members))

    def join(self, states: list[Any]) -> "HeldBatch":
        """This batch holding ``states``' rows, in order: members not among them leave
        (:meth:`remove`), the others are appended; members that stay keep their rows
        where they are. ``states`` lists those that stay first, in the batch's order
        (otherwise every member leaves and all join again)."""
        if self.holds(states):
            return self
        for member in [m for m in self.members if all(m is not s for s in states)]:
            self.remove(member)
        if not all(a is b for a, b in zip(self.members, states)):
            self.clear()
        joiners = states[len(self.members):]
        for state in joiners:  # rows another batch holds go back to their owner first
            other = getattr(state, self.slot)
            if other is not None:
                other.remove(state)
        self._extend(joiners)
        self.members = list(states)
        for row, state in enumerate(states):
            setattr(state, self.slot, self)
            setattr(state, self.slot + "_row", row)
        return self

    def remove(self, member: Any) -> None:
        """``member``'s rows given back as its own state (copies, evaluated now); the
        other members stay stacked as they are, so the next frame forms nothing."""
        row = next(b for b, m in enumerate(self.members) if m is member)
        self.members.pop(row)
        setattr(member, self.slot, None)
        for b, state in enumerate(self.members):
            setattr(state, self.slot + "_row", b)
        arrays = self._remove(member, row)
        if self.members:  # a last member's rows are its own already
            mx.eval(arrays)

    def clear(self) -> None:
        """Every member takes its rows back."""
        for member in list(self.members):
            self.remove(member)

    def _extend(self, states: list[Any]) -> None:
        """Append ``states``' rows after the members'."""
        raise NotImplementedError

    def _remove(self, member: Any, row: int) -> list[mx.array]:
        """Give ``member`` (row ``row``) its rows back, keep the others; the arrays made."""
        raise NotImplementedError
