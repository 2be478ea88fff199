"""The per-frame recurrence, shared by offline generation and streaming.

One position of the timeline is one 80 ms frame:

1. the LLM reads ``E(prev_text) + audio + w * E(prev_function)`` and its two
   heads give this position's text and function tokens (pad while a system
   prompt prefix is being read);
2. from the second position on, EAR-TTS advances one frame: it reads the
   previous frame's 31 codes (reset to codec silence when the text token is
   EOS) and the current text token, and samples this frame's codes.

The first position has no TTS step; its codes are the codec's silence codes.
Everything here is one timeline; :func:`~.frame.advance` drives it one frame
at a time for offline and streaming conversations alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import mlx.core as mx

from ..models.model import Model
from .profile import FrameClock
from .prompt_cache import clone_state, state_arrays
from .rng import RandomStream

_NO_CLOCK = FrameClock(enabled=False)


class PrefillCancelled(RuntimeError):
    """The system-prompt prefill was stopped (the client left, or the server shuts down)."""


@dataclass
class Tokens:
    """A position's tokens, possibly not yet evaluated."""

    text: mx.array  # (1,) int32
    ids: mx.array  # (2,) int32: text, function
    forced: bool  # the function id was forced, not predicted


@dataclass
class TimelineStep:
    """What one position produced: host ids and the codes (evaluated by ``step``)."""

    index: int
    text_id: int
    function_id: int
    codes: mx.array  # (1, 1, Q) raw codes, control codes not yet replaced
    function_forced: bool = False  # ``function_id`` was forced, not predicted


@dataclass(frozen=True)
class WarmStart:
    """What every session starts from: the EAR-TTS caches after the speaker-prompt
    warm-up and the codes of its last frame. A pure function of the weights, so
    it is computed once per loaded model (:func:`warm_start`) and copied."""

    tts_cache: list[Any]
    prev_codes: mx.array  # (1, 1, Q)

    def fresh_cache(self) -> list[Any]:
        """Per-session caches: new objects and new array handles over the same values
        (:func:`~.prompt_cache.clone_state`), so sessions never see each other's writes."""
        return clone_state(self.tts_cache)


def warm_start(model: Model) -> WarmStart:
    """The model's :class:`WarmStart`, computed (and evaluated) on first use."""
    start = getattr(model, "warm_start", None)
    if start is None:
        codes, ids, id_mask, audio_mask, latents = model.tts_model.warmup_inputs(
            model.config.pad_token_id
        )
        hidden, cache = model.tts_model.tts_model.warmup(codes, ids, id_mask, audio_mask, latents)
        start = WarmStart(cache, codes[:, -1:])
        # Evaluating the warm-up output materializes the backbone KV caches too.
        mx.eval(hidden, start.prev_codes, [c.state for c in cache])
        model.warm_start = start  # a plain attribute: not part of the module tree
    return start


class LanguageState:
    """Nemotron-H across positions: persistent caches, or full recompute."""

    def __init__(self, model: Model, use_cache: bool):
        self.stt = model.stt_model
        self.cache = self.stt.make_cache() if use_cache else None
        self.history: list[mx.array] = []

    def __call__(self, fused: mx.array) -> tuple[mx.array, mx.array]:
        if self.cache is not None:
            text, function = self.stt.step(fused, self.cache)
        else:
            self.history.append(fused)
            text, function = self.stt(mx.concatenate(self.history, axis=1))
        return text[:, -1], function[:, -1]


def language_batch(states: list[LanguageState], fused: mx.array) -> tuple[mx.array, mx.array]:
    """Row ``b`` of ``fused`` through ``states[b]``: cached sessions in one batched step."""
    if len(states) == 1:
        return states[0](fused)
    if all(s.cache is not None for s in states):
        text, function = states[0].stt.step_batch(fused, [s.cache for s in states])
        return text[:, -1], function[:, -1]
    outs = [s(fused[b : b + 1]) for b, s in enumerate(states)]  # full recompute: alone
    return mx.concatenate([t for t, _ in outs]), mx.concatenate([f for _, f in outs])


class Timeline:
    def __init__(self, model: Model, *, seed: int = 0, use_language_cache: bool = True):
        self.model = model
        self.config = model.config
        self.rng = RandomStream(seed)
        self.language = LanguageState(model, use_language_cache)
        self.index = 0
        pad = self.config.pad_token_id
        self._prev_text = mx.array([[pad]], dtype=mx.int32)
        self._prev_function = mx.array([[pad]], dtype=mx.int32)
        self._pad = mx.array([pad], dtype=mx.int32)
        speech = model.tts_model
        self._silence = speech.codec_silence_tokens.astype(mx.int32).reshape(1, 1, -1)
        start = warm_start(model)
        self.tts_cache = start.fresh_cache()
        self._prev_codes = start.prev_codes

    @property
    def state(self) -> list[mx.array]:
        """Every array the recurrence carries (language and TTS caches, key, previous tokens)."""
        return state_arrays(self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        """The whole recurrence state (shares arrays: clone it before keeping it)."""
        return {
            "language_cache": self.language.cache, "history": self.language.history,
            "tts_cache": self.tts_cache, "key": self.rng._key, "index": self.index,
            "prev_text": self._prev_text, "prev_function": self._prev_function,
            "prev_codes": self._prev_codes,
        }

    def release(self) -> None:
        """Drop every array the recurrence carries; the timeline is unusable afterwards."""
        self.language.cache, self.language.history = None, []
        self.tts_cache, self.rng._key = [], None
        self._prev_text = self._prev_function = self._prev_codes = None

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`snapshot` (a private copy: this timeline will write to it)."""
        self.language.cache, self.language.history = state["language_cache"], state["history"]
        self.tts_cache, self.rng._key, self.index = state["tts_cache"], state["key"], state["index"]
        self._prev_text, self._prev_function = state["prev_text"], state["prev_function"]
        self._prev_codes = state["prev_codes"]

    def prefill(
        self, prompt_ids: list[int], should_stop: Callable[[], bool] | None = None
    ) -> None:
        """Read system-prompt tokens on the audio channel, one position each.

        The embeddings enter in float32, the dtype of the audio embeddings they
        stand in for (the reference's offline path does the same; its streaming
        path feeds them in bf16, see conformance/README.md). ``should_stop`` is
        asked before every position; when it says so, :class:`PrefillCancelled`
        is raised (the timeline is then unusable).
        """
        for _ in self.prefill_steps(prompt_ids, should_stop):
            pass

    def prefill_steps(
        self, prompt_ids: list[int], should_stop: Callable[[], bool] | None = None
    ) -> Iterator[int]:
        """:meth:`prefill` one position at a time: yields the positions still to read.

        A caller that serves other sessions between positions (the server's
        engine) bounds how long a prefill holds them up; every position is
        evaluated on its own either way, so the state is the same.
        """
        if not prompt_ids:
            return
        ids = mx.array([prompt_ids], dtype=mx.int32)
        prompt = self.model.stt_model.embed_tokens(ids).astype(mx.float32)
        for p in range(len(prompt_ids)):
            if should_stop is not None and should_stop():
                raise PrefillCancelled(f"prefill stopped at position {p} of {len(prompt_ids)}")
            self.step(prompt[:, p : p + 1], generate=False)
            yield len(prompt_ids) - p - 1

    def listen(
        self,
        audio: mx.array,
        *,
        generate: bool = True,
        force_function: int | None = None,
        clock: FrameClock = _NO_CLOCK,
    ) -> Tokens:
        """The language half of a position, lazily: ``(1, 1, H)`` audio -> its tokens.

        ``force_function`` replaces the function head's prediction (teacher
        forcing, used to inject tool results): the forced id is this position's
        function token and the next position's previous-function input.
        Evaluate ``Tokens.ids`` (with any other work of the frame), then call
        :meth:`speak`.
        """
        if not generate:
            return listen_prompt(self, audio, clock)
        return listen_batch([self], audio, [force_function], clock)[0]

    def _take(self, text: mx.array, function: mx.array, forced: bool) -> Tokens:
        """This position's tokens (``(1,)`` each) become the next position's inputs."""
        self._prev_text = text[:, None]
        self._prev_function = function[:, None]
        return Tokens(text, mx.concatenate([text, function]), forced)

    def speak(self, tokens: Tokens, clock: FrameClock = _NO_CLOCK) -> TimelineStep:
        """The speech half, after ``tokens.ids`` was evaluated: lazy codes for the position.

        The TTS text conditioning spells the text token on the host, which is
        why the language half is evaluated first. Evaluate ``step.codes`` next.
        """
        return speak_batch([self], [tokens], clock)[0]

    def _previous_codes(self, tokens: Tokens) -> mx.array:
        """The TTS's previous-frame input: the last codes, or silence after EOS."""
        is_eos = (tokens.text == self.config.eos_token_id).reshape(1, 1, 1)
        return mx.where(is_eos, self._silence, self._prev_codes)

    def step(
        self,
        audio: mx.array,
        *,
        generate: bool = True,
        force_function: int | None = None,
        clock: FrameClock = _NO_CLOCK,
    ) -> TimelineStep:
        """Advance one position: :meth:`listen`, evaluate, :meth:`speak`, evaluate.

        Two host round trips: the token ids, then the codes (``clock`` may add
        stage barriers when profiling).
        """
        tokens = self.listen(audio, generate=generate, force_function=force_function, clock=clock)
        mx.eval(tokens.ids)
        step = self.speak(tokens, clock)
        mx.eval(step.codes)
        clock.stage("tts")
        return step


def listen_prompt(timeline: Timeline, audio: mx.array, clock: FrameClock = _NO_CLOCK) -> Tokens:
    """A prompt position: the LLM reads it, its heads are muted (pad on both channels)."""
    stt = timeline.model.stt_model
    fused = stt.fuse(timeline._prev_text, audio, timeline._prev_function)
    timeline.language(fused)
    clock.stage("language", timeline._pad)
    return timeline._take(timeline._pad, timeline._pad, False)


def listen_batch(timelines: list[Timeline], audio: mx.array, forced: list[int | None],
                 clock: FrameClock = _NO_CLOCK) -> list[Tokens]:
    """The language half of one position of many timelines, lazily.

    Row ``b`` of ``audio`` (``(B, 1, H)``) is timeline ``b``'s; ``forced[b]``
    replaces its function head's prediction (teacher forcing, used to inject
    tool results). Every row's tokens equal that timeline's own
    :meth:`Timeline.listen`: the fused inputs, the Mamba2/MLP runs and the
    heads take all rows at once, and each row attends over its own KV cache.
    Evaluate the tokens' ``ids``, then :meth:`Timeline.speak` each timeline.
    """
    stt = timelines[0].model.stt_model
    if len(timelines) == 1:
        prev_text, prev_function = timelines[0]._prev_text, timelines[0]._prev_function
    else:
        prev_text = mx.concatenate([t._prev_text for t in timelines])
        prev_function = mx.concatenate([t._prev_function for t in timelines])
    fused = stt.fuse(prev_text, audio, prev_function)
    text_logits, function_logits = language_batch([t.language for t in timelines], fused)
    text = mx.argmax(text_logits, axis=-1).astype(mx.int32)
    predicted = mx.argmax(function_logits, axis=-1).astype(mx.int32)
    if len(timelines) == 1:
        function = predicted if forced[0] is None else mx.array([forced[0]], dtype=mx.int32)
        clock.stage("language", text, function)
        return [timelines[0]._take(text, function, forced[0] is not None)]
    tokens = []
    for b, (timeline, force) in enumerate(zip(timelines, forced)):
        function = predicted[b : b + 1] if force is None else mx.array([force], dtype=mx.int32)
        tokens.append(timeline._take(text[b : b + 1], function, force is not None))
    clock.stage("language", *[t.ids for t in tokens])
    return tokens


def speak_batch(timelines: list[Timeline], tokens: list[Tokens],
                clock: FrameClock = _NO_CLOCK) -> list[TimelineStep]:
    """The speech half of one position of many timelines, after their ids were evaluated.

    Every timeline past its first position advances EAR-TTS by one frame; with
    more than one, the backbone and the depth head take all of them at once
    (:meth:`~..models.ear_tts.EarTTS.backbone_step_batch`, each session's own
    caches and key stream; every row equals that timeline's own step). A
    first position's codes are the codec's silence codes. Evaluate the steps'
    ``codes`` next.
    """
    ids = [t.ids.tolist() for t in tokens]
    codes: list[mx.array] = [t._silence for t in timelines]
    talking = [b for b, t in enumerate(timelines) if t.index > 0]
    if talking:
        tts = timelines[0].model.tts_model.tts_model
        previous = [timelines[b]._previous_codes(tokens[b]) for b in talking]
        if len(talking) == 1:
            (b,) = talking
            hidden = tts.backbone_step(previous[0], tokens[b].text[:, None],
                                       timelines[b].tts_cache, ids[b][0])
        else:
            hidden = tts.backbone_step_batch(
                mx.concatenate(previous),
                mx.concatenate([tokens[b].text for b in talking])[:, None],
                [timelines[b].tts_cache for b in talking], [ids[b][0] for b in talking])
        mx.async_eval(hidden)  # computes while the depth loop is built
        clock.sub_stage("tts.backbone", hidden)
        if len(talking) == 1:
            made = [tts.generate_codes(hidden, timelines[talking[0]].rng)]
        else:
            out = tts.generate_codes_batch(hidden, [timelines[b].rng for b in talking])
            made = [out[j : j + 1] for j in range(len(talking))]
        clock.sub_stage("tts.mog_head", *made)
        for b, frame_codes in zip(talking, made):
            codes[b] = timelines[b]._prev_codes = frame_codes
    steps = []
    for timeline, (text_id, function_id), frame_codes, token in zip(timelines, ids, codes, tokens):
        steps.append(TimelineStep(timeline.index, text_id, function_id, frame_codes, token.forced))
        timeline.index += 1
    return steps
