"""One frame of compute: a conversation's state and one frame of input in, host values out.

:func:`advance` moves every network of one conversation forward by one 80 ms
frame (perception, the RNNT's tries, the LLM position, the EAR-TTS frame, the
codec) and returns what the frame produced as host values
(:class:`FrameOutput`). It keeps no books: turning outputs into events (text
deltas, tool calls, transcripts, audio framing) is
:class:`~.conversation.Conversation`'s job, the same for offline and
streaming conversations.

The frame takes two evaluations, the hearing half then the speaking half.
The first evaluates the encoder step, the RNNT's first try and the token ids
(the TTS spells the text token on the host); the second the RNNT's other
tries, the TTS codes and the codec samples. Work is started as soon as its
graph is built (``async_eval``), so MLX computes one part while this thread
builds the next and ``on_tokens`` decodes the token texts.

A batch of rows (:func:`advance_batch`) runs every row's hearing half
(:class:`~.hearing.Hearing`: perception and the RNNT's tries, one batch for all rows),
and the speaking half for the rows that are conversations; a transcript-only
stream's row stops after the hearing half (:class:`Heard`). The rows' state
between frames is a :class:`Batch`'s, the one owner while they step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

import mlx.core as mx
import numpy as np

from ..models.cache_state import split_state
from ..models.codec.codec_stream import CodecRows, CodecState
from ..models.language.context import ContextWindow
from ..models.model import Model
from ..models.perception.perception_stream import PerceptionStream
from ..models.rnnt.rnnt import RNNTState
from ..models.rows import take_rows
from .hearing import Hearing, HearingBatch, HearingRow
from .profile import NO_CLOCK, FrameClock
from .timeline import Timeline, TimelineStep
from .warm_start import WarmStart


class WholeSignal:
    """Perception already run over the whole signal (offline turns): frame ``t`` is a slice."""

    def __init__(self, projected: mx.array, encoded: mx.array):
        self.projected, self.encoded = projected, encoded

    @property
    def state(self) -> list[mx.array]:
        """No carried arrays: the whole signal's outputs are inputs, not state."""
        return []

    @state.setter
    def state(self, value: list[mx.array]) -> None:
        if value:
            raise ValueError(f"a whole-signal source carries no state, got {len(value)} arrays")

    def push(self, frame: int) -> tuple[mx.array, mx.array]:
        return self.projected[:, frame : frame + 1], self.encoded[:, frame : frame + 1]


# Where a frame's audio embeddings come from: the streaming encoder, or a whole signal.
PerceptionSource = Union[PerceptionStream, WholeSignal]


@dataclass
class FrameOutput:
    """What one frame produced, on the host."""

    text_id: int
    function_id: int
    function_forced: bool
    codes: np.ndarray  # (Q,) int32, control codes replaced by silence
    samples: np.ndarray  # float32: what the codec released this frame
    symbols: list[int] | None  # the RNNT's symbols (for ``RNNTState.commit``)


@dataclass
class Heard:
    """What one frame of a transcript-only row produced: the RNNT's symbols."""

    symbols: list[int] | None


class ConversationState(HearingRow):
    """Everything one conversation carries between frames, as one list of arrays.

    Perception source, Nemotron-H and EAR-TTS caches (in the :class:`Timeline`),
    the RNNT carry and the codec stream, in mlx-lm's cache convention:
    ``state`` lists their arrays, ``meta_state`` the host values that lay
    them out again, and ``state = ...`` restores arrays into the same layout;
    :meth:`restore` takes a ``(state, meta_state)`` snapshot of any
    conversation of the same model (the prompt cache restores a prefilled
    one). Host books (the transcript's text, the mel frontend's sample tail)
    stay with their streams. ``nbytes`` sizes the state, ``release`` drops it.
    While a batch holds its rows (:attr:`held`), ``timeline`` and ``codec`` are
    ``None`` and ``state`` raises: ``StreamPool.extract`` gives the rows back first.
    """

    def __init__(self, model: Model, perception: PerceptionSource, rnnt: RNNTState,
                 *, start: WarmStart, seed: int, use_language_cache: bool,
                 context: tuple[ContextWindow, ContextWindow] | None = None,
                 top_p: float | None = None):
        self.perception: PerceptionSource | None = perception  # None: a batch's rows
        self.timeline: Timeline | None = Timeline(model, start, seed=seed, use_language_cache=use_language_cache,
                                  context=context, top_p=top_p)
        self.rnnt = rnnt
        self.codec: CodecState | None = model.tts_model.audio_codec.make_state()

    def _parts(self) -> tuple[Any, ...]:
        self.check_own()
        return (self.perception, self.timeline, self.rnnt, self.codec)

    @property
    def state(self) -> list[mx.array]:
        if self.codec is None and not self.held:  # released (a member's is the batch's rows)
            return []
        return [a for part in self._parts() for a in part.state]

    @state.setter
    def state(self, value: list[mx.array]) -> None:
        self.restore(value, self.meta_state)

    @property
    def meta_state(self) -> tuple:
        """Each part's array count, then the timeline's and the codec's meta states."""
        return (tuple(len(part.state) for part in self._parts()),
                self.timeline.meta_state, self.codec.meta_state)

    def restore(self, state: list[mx.array], meta_state: tuple) -> None:
        """Continue from a ``(state, meta_state)`` snapshot (mlx-lm's ``from_state``, in
        place: the conversation keeps its networks and books). The arrays become this
        conversation's own: give it a copy of a snapshot that is kept."""
        counts, timeline, codec = meta_state
        perception, timeline_arrays, rnnt, codec_arrays = split_state(state, counts)
        self.perception.state, self.rnnt.state = perception, rnnt
        top_p = self.timeline.top_p  # a session option: the snapshot's rows take this one's
        self.timeline = Timeline.from_state(self.timeline.model, timeline_arrays, timeline)
        self.timeline.top_p = top_p
        self.codec = CodecState.from_state(codec_arrays, codec)

    def release(self) -> None:
        """Drop every array reference (``state`` is then empty and the state unusable)."""
        self.check_own()
        self.perception = WholeSignal(mx.zeros((1, 0, 1)), mx.zeros((1, 0, 1)))
        self.timeline.release()
        self.rnnt.release()
        self.codec = None


class Batch:
    """The rows of the sessions that step together: the one owner of their state while
    they step (a pool holds one; a frame run alone makes its own).

    ``members`` are the rows in order. Their hearing half is :attr:`hearing`;
    the conversations among them, in the same order, step one merged
    :class:`Timeline` and one stacked :class:`~..models.codec_stream.CodecRows`.
    :meth:`update` is where membership changes, once: the members that leave
    take their rows back (:meth:`extract`: mlx-lm's ``extract`` and ``filter``),
    those that join are appended (``extend``), those that stay are not moved;
    while the same rows step in the same order a frame stacks and slices
    nothing. A member's bytes are read from its rows (:meth:`nbytes`).
    """

    def __init__(self) -> None:
        self.members: list[HearingRow] = []
        self.hearing = HearingBatch(self.members)
        self.timeline: Timeline | None = None
        self.codec: CodecRows | None = None
        self.pending: list[mx.array] = []  # leavers' copies, evaluated with the next frame

    def update(self, states: list[HearingRow]) -> None:
        """Hold ``states``' rows, in order. ``states`` lists the members that stay first,
        in the batch's order (otherwise every member leaves and all join again). The
        leavers' copies are evaluated with the next frame (:attr:`pending`)."""
        for member in [m for m in self.members if all(m is not s for s in states)]:
            self.pending += self._remove(member)
        if not all(a is b for a, b in zip(self.members, states)):
            self.clear()
        joiners = states[len(self.members):]
        for state in joiners:
            state.check_own()
        self.hearing.extend(joiners)
        talkers = [s for s in joiners if isinstance(s, ConversationState)]
        if any(s.codec is None for s in talkers):
            raise ValueError("a released conversation cannot step")
        if talkers:
            self.timeline = Timeline.merge([*([self.timeline] if self.timeline else []),
                                            *(s.timeline for s in talkers)])
            self.codec = self.codec or CodecRows([])
            self.codec.extend([s.codec for s in talkers])
        for state in talkers:  # its state is the batch's rows now; it keeps its books
            state.timeline = state.codec = None
        self.members[:] = states
        for state in joiners:
            state.held = True

    def extract(self, member: HearingRow) -> None:
        """``member``'s rows given back as its own state (copies, evaluated now); the
        other members stay stacked as they are, so the next frame forms nothing. A state
        the batch does not hold is its own already."""
        if member.held:
            mx.eval(self._remove(member))

    def _remove(self, member: HearingRow) -> list[mx.array]:
        """Take ``member``'s rows out; the arrays made (none for a last member, whose
        rows are its own already)."""
        row, talker = self._rows(member)
        self.members.pop(row)
        member.held = False
        arrays = self.hearing.remove(row, member)
        if isinstance(member, ConversationState):
            timeline, codec = self.timeline, self.codec
            if timeline.batch_size == 1:  # the last conversation
                self.timeline = self.codec = None
            member.timeline, member.codec = timeline.remove(talker), codec.remove(talker)
            arrays += [*member.timeline.state, *member.codec.state, *timeline.state, *codec.state]
        return arrays if self.members else []

    def _rows(self, member: HearingRow) -> tuple[int, int]:
        """``member``'s row among the members, and among the conversations (its timeline
        and codec row)."""
        row = next(b for b, m in enumerate(self.members) if m is member)
        return row, sum(isinstance(m, ConversationState) for m in self.members[:row])

    def clear(self) -> None:
        """Every member takes its rows back."""
        for member in list(self.members):
            self.extract(member)

    def nbytes(self, state: HearingRow) -> int:
        """The bytes of ``state``, read from its rows without taking them out while
        this batch holds them."""
        if not state.held:
            return state.nbytes
        row, talker = self._rows(state)
        held = self.hearing.row_nbytes(row)
        if isinstance(state, ConversationState):
            held += self.timeline.row_nbytes(talker) + self.codec.row_nbytes(talker)
        return held


def advance(
    model: Model,
    state: ConversationState,
    frame: Any,
    *,
    forced: int | None = None,
    clock: FrameClock = NO_CLOCK,
    on_tokens: Callable[[TimelineStep], None] | None = None,
) -> FrameOutput:
    """Advance ``state`` by one frame of input (``frame``: PCM, or a frame index offline).

    ``forced`` replaces the function head's prediction (an injected tool
    result token). ``on_tokens`` is called with the frame's ids while the
    speaking half computes. Profiling (``clock``) adds its own stage barriers.
    """
    return advance_batch(model, [state], [frame], [forced], clock, [on_tokens])[0]


def advance_batch(
    model: Model,
    states: list[Any],
    frames: list[Any],
    forced: list[int | None],
    clock: FrameClock = NO_CLOCK,
    on_tokens: list[Callable[[TimelineStep], None] | None] | None = None,
    batch: Batch | None = None,
) -> list[FrameOutput | Heard]:
    """Advance many rows by one frame each, in one compute per stage where it batches.

    Row ``b`` is ``states[b]`` with input ``frames[b]``: a :class:`ConversationState`
    (every network; a :class:`FrameOutput`) or a transcript-only row (anything with
    a ``perception`` and an ``rnnt``; a :class:`Heard`). Every row's hearing half
    (perception, RNNT) runs in one batch; the speaking half only for the
    conversations. Each row's outputs equal :func:`advance` on it alone (the
    language model's attention-free runs and heads take all rows at once; every
    row keeps its own caches). ``advance`` is this with one row. ``batch``: the
    caller's (a pool's), which holds ``states``' rows already
    (:meth:`Batch.update`); without it, this frame's, whose rows go back after it.
    """
    own = batch is None
    if batch is None:
        batch = Batch()
        batch.update(states)
    hearing = Hearing(batch.hearing, frames, clock)
    talking = [b for b, s in enumerate(states) if isinstance(s, ConversationState)]
    timeline, codec_rows = batch.timeline, batch.codec
    ids = []
    if timeline is not None:
        tokens = timeline.listen(take_rows(hearing.projected, talking),
                                 [forced[b] for b in talking], clock=clock)
        ids = [tokens.ids]
    mx.eval(*ids, *hearing.arrays, *batch.pending)
    batch.pending = []

    # The user transcript does not feed the timeline: the RNNT's other tries
    # (after an emission) join the speech half's evaluation.
    speaking = hearing.rest(clock)
    steps: list[TimelineStep] = []
    outputs: list[tuple[np.ndarray, np.ndarray]] = []
    if timeline is not None:
        steps = timeline.speak(tokens, clock)
        clock.stage("tts", timeline.codes)
        speech = model.tts_model
        # Control codes replaced once over every row's codes.
        codes = speech.replace_control_codes(timeline.codes)
        # The codec reads [B, Q, 1]: one transpose, every row's codes one batch.
        waveforms = speech.audio_codec.decode_streams(codes.transpose(0, 2, 1), codec_rows)
        heard_codes = codes[:, 0].astype(mx.int32)
        # Whole arrays evaluated and read to the host once, each row a view of them.
        batches = list({id(a): a for a, _ in waveforms}.values())
        speaking += [timeline.codes, heard_codes, *codec_rows.state, *batches]
        mx.async_eval(*speaking)
        for b, step in zip(talking, steps):
            if on_tokens is not None and on_tokens[b] is not None:
                on_tokens[b](step)
    if speaking:
        mx.eval(*speaking)
    if talking:
        clock.sub_stage("codec.decoder_istft")
        clock.stage("codec")
        host = {id(a): np.array(a) for a in (heard_codes, *batches)}
        outputs = [(host[id(heard_codes)][j], host[id(a)][row, 0])
                   for j, (a, row) in enumerate(waveforms)]
    symbols = hearing.symbols()
    results: list[FrameOutput | Heard] = [Heard(s) for s in symbols]
    for b, step, (heard, samples) in zip(talking, steps, outputs):
        results[b] = FrameOutput(step.text_id, step.function_id, step.function_forced,
                                 heard, samples, symbols[b])
    if own:  # this frame's batch: its rows go back (one row moves no data)
        batch.clear()
    return results


def finish_audio(model: Model, state: ConversationState) -> np.ndarray:
    """The codec's held tail: the last samples of the stream's last frame."""
    tail = model.tts_model.audio_codec.flush(state.codec)
    return np.array(tail[0, 0])
