"""One frame of compute: a conversation's state and one frame of input in, host values out.

:func:`advance` moves every network of one conversation forward by one 80 ms
frame (perception, the RNNT's tries, the LLM position, the EAR-TTS frame, the
codec) and returns what the frame produced as host values
(:class:`FrameOutput`). It keeps no books: turning outputs into events (text
deltas, tool calls, transcripts, audio framing) is
:class:`~.conversation.Conversation`'s job, the same for offline and
streaming conversations.

The frame takes two evaluations, the listening half then the speaking half.
The first evaluates the encoder step, the RNNT's first try and the token ids
(the TTS spells the text token on the host); the second the RNNT's other
tries, the TTS codes and the codec samples. Work is started as soon as its
graph is built (``async_eval``), so MLX computes one part while this thread
builds the next and ``on_tokens`` decodes the token texts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import mlx.core as mx
import numpy as np

from ..models.cache_state import split_state
from ..models.codec_stream import CodecState
from ..models.model import Model
from ..models.perception_stream import PerceptionStream
from ..models.rnnt import RNNTState
from .profile import FrameClock
from .timeline import Timeline, TimelineStep, WarmStart

_NO_CLOCK = FrameClock(enabled=False)


class PerceptionSource(Protocol):
    """Where a frame's audio embeddings come from: the streaming encoder, or a whole signal."""

    @property
    def state(self) -> list[mx.array]: ...

    def push(self, frame: Any, clock: Any = None) -> tuple[mx.array, mx.array]: ...


class WholeSignal:
    """Perception already run over the whole signal (offline turns): frame ``t`` is a slice."""

    def __init__(self, projected: mx.array, encoded: mx.array):
        self.projected, self.encoded = projected, encoded
        self.frames = projected.shape[1]

    @property
    def state(self) -> list[mx.array]:
        return []

    def push(self, frame: int, clock: Any = None) -> tuple[mx.array, mx.array]:
        return self.projected[:, frame : frame + 1], self.encoded[:, frame : frame + 1]


@dataclass
class FrameOutput:
    """What one frame produced, on the host."""

    text_id: int
    function_id: int
    function_forced: bool
    codes: np.ndarray  # (Q,) int32, control codes replaced by silence
    samples: np.ndarray  # float32: what the codec released this frame
    symbols: mx.array | None  # the RNNT's evaluated symbols (for ``RNNTState.commit``)


class ConversationState:
    """Everything one conversation carries between frames, as one list of arrays.

    Perception source, Nemotron-H and EAR-TTS caches (in the :class:`Timeline`),
    the RNNT carry and the codec stream, in mlx-lm's cache convention:
    ``state`` lists their arrays, ``meta_state`` the host values that lay
    them out again, and ``state = ...`` restores arrays into the same layout;
    :meth:`restore` takes a ``(state, meta_state)`` snapshot of any
    conversation of the same model (the prompt cache restores a prefilled
    one). Host books (the transcript's text, the mel frontend's sample tail)
    stay with their streams. ``nbytes`` sizes the state, ``release`` drops it.
    """

    def __init__(self, model: Model, perception: PerceptionSource, rnnt: RNNTState,
                 *, start: WarmStart, seed: int, use_language_cache: bool):
        self.perception = perception
        self.timeline = Timeline(model, start, seed=seed, use_language_cache=use_language_cache)
        self.rnnt = rnnt
        self.codec: CodecState | None = model.tts_model.audio_codec.make_state()

    def _parts(self) -> tuple[Any, ...]:
        return (self.perception, self.timeline, self.rnnt, self.codec)

    @property
    def state(self) -> list[mx.array]:
        if self.codec is None:  # released
            return []
        return [a for part in self._parts() for a in part.state]

    @state.setter
    def state(self, value: list[mx.array]) -> None:
        self.restore(value, self.meta_state)

    @property
    def meta_state(self) -> tuple:
        """Each part's array count, then the timeline's and the codec's meta states."""
        assert self.codec is not None, "the state was released"
        return (tuple(len(part.state) for part in self._parts()),
                self.timeline.meta_state, self.codec.meta_state)

    def restore(self, state: list[mx.array], meta_state: tuple) -> None:
        """Continue from a ``(state, meta_state)`` snapshot (mlx-lm's ``from_state``, in
        place: the conversation keeps its networks and books). The arrays become this
        conversation's own: give it a copy of a snapshot that is kept."""
        counts, timeline, codec = meta_state
        perception, timeline_arrays, rnnt, codec_arrays = split_state(state, counts)
        for part, arrays in ((self.perception, perception), (self.rnnt, rnnt)):
            if arrays or part.state:  # a part without arrays either way has nothing to set
                part.state = arrays
        self.timeline = Timeline.from_state(self.timeline.model, timeline_arrays, timeline)
        self.codec = CodecState.from_state(codec_arrays, codec)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def release(self) -> None:
        """Drop every array reference (``state`` is then empty and the state unusable)."""
        self.perception = WholeSignal(mx.zeros((1, 0, 1)), mx.zeros((1, 0, 1)))
        self.timeline.release()
        self.rnnt.release()
        self.codec = None


def advance(
    model: Model,
    state: ConversationState,
    frame: Any,
    *,
    forced: int | None = None,
    clock: FrameClock = _NO_CLOCK,
    on_tokens: Callable[[TimelineStep], None] | None = None,
) -> FrameOutput:
    """Advance ``state`` by one frame of input (``frame``: PCM, or a frame index offline).

    ``forced`` replaces the function head's prediction (an injected tool
    result token). ``on_tokens`` is called with the frame's ids while the
    speaking half computes. Profiling (``clock``) adds its own stage barriers.
    """
    return advance_batch(model, [state], [frame], [forced], clock,
                         None if on_tokens is None else [on_tokens])[0]


def advance_batch(
    model: Model,
    states: list[ConversationState],
    frames: list[Any],
    forced: list[int | None],
    clock: FrameClock = _NO_CLOCK,
    on_tokens: list[Callable[[TimelineStep], None]] | None = None,
) -> list[FrameOutput]:
    """Advance many conversations by one frame each, in one compute per stage where it batches.

    Row ``b`` is ``states[b]`` with input ``frames[b]``; each conversation's
    outputs equal :func:`advance` on it alone (the language model's
    attention-free runs and heads take all rows at once; every row keeps its
    own caches). ``advance`` is this with one row.
    """
    sources = [s.perception for s in states]
    if all(isinstance(s, PerceptionStream) for s in sources):
        pairs = PerceptionStream.push_batch(sources, frames, clock)
    else:  # offline: slices of the whole-signal perception
        pairs = [source.push(frame, clock) for source, frame in zip(sources, frames)]
    projected, encoded = [p for p, _ in pairs], [e for _, e in pairs]
    listening: list[mx.array] = [*projected, *encoded]
    for state in states:
        listening += state.perception.state
    clock.stage("perception", *listening)
    mx.async_eval(*listening)
    # The RNNT's first try joins the first evaluation; a blank (most frames
    # of real speech) ends the frame's transcript work there.
    firsts = RNNTState.advance_first_batch([s.rnnt for s in states], encoded)
    for state, first in zip(states, firsts):
        if first is not None:
            listening += [first, *state.rnnt.state]
    timeline = Timeline.merge([s.timeline for s in states])
    tokens = timeline.listen(mx.concatenate(projected), forced, clock=clock)
    mx.eval(tokens.ids, *listening)

    # The user transcript does not feed the timeline: the RNNT's other tries
    # (after an emission) compute while the speech half is built.
    symbols = RNNTState.advance_rest_batch([s.rnnt for s in states], firsts)
    speaking = []
    for state, first, rest in zip(states, firsts, symbols):
        if rest is not None and rest is not first:
            speaking += [rest, *state.rnnt.state]
    if speaking:
        mx.async_eval(*speaking)
    clock.stage("rnnt", *speaking)
    steps = timeline.speak(tokens, clock)
    for b, state in enumerate(states):
        state.timeline = timeline.extract(b)
    clock.stage("tts", *[step.codes for step in steps])
    speech = model.tts_model
    codes = [speech.replace_control_codes(step.codes) for step in steps]
    waveforms = speech.audio_codec.decode_streams([c.transpose(0, 2, 1) for c in codes],
                                                  [s.codec for s in states])
    outputs = []
    for state, step, code, samples in zip(states, steps, codes, waveforms):
        outputs.append((samples[0, 0], code[0, 0].astype(mx.int32)))
        speaking += [step.codes, *outputs[-1], *state.codec.state]
    mx.async_eval(*speaking)
    if on_tokens is not None:
        for callback, step in zip(on_tokens, steps):
            callback(step)
    mx.eval(*speaking)
    clock.sub_stage("codec.decoder_istft")
    clock.stage("codec")
    return [
        FrameOutput(step.text_id, step.function_id, step.function_forced,
                    np.array(codes), np.array(samples), rest)
        for step, (samples, codes), rest in zip(steps, outputs, symbols)
    ]


def finish_audio(model: Model, state: ConversationState) -> np.ndarray:
    """The codec's held tail: the last samples of the stream's last frame."""
    tail = model.tts_model.audio_codec.flush(state.codec)
    return np.array(tail[0, 0])
