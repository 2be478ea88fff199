"""The per-frame recurrence, shared by offline generation and streaming.

One position of the timeline is one 80 ms frame:

1. the LLM reads ``E(prev_text) + audio + w * E(prev_function)`` and its two
   heads give this position's text and function tokens (pad while a system
   prompt prefix is being read);
2. from the second position on, EAR-TTS advances one frame: it reads the
   previous frame's 31 codes (reset to codec silence when the text token is
   EOS) and the current text token, and samples this frame's codes.

The first position has no TTS step; its codes are the codec's silence codes.
A :class:`Timeline` carries this recurrence for ``B`` conversations at once
(one conversation is ``B = 1``): :func:`~.compute.advance_batch` runs one
position of the stepping conversations' merged timeline, which a
:class:`~.compute.Batch` keeps while the same conversations step and
hands back row by row when they change, for offline and streaming
conversations alike.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Iterator, Sequence

import mlx.core as mx

from ..models.cache_state import (
    cache_meta_state,
    cache_state,
    caches_from_state,
    split_state,
    state_nbytes,
)
from ..models.language.context import ContextWindow
from ..models.language.duplex import LanguageRows, LanguageState
from ..models.speech.ear_tts import GUIDED_ROWS
from ..models.kv_arena import KVArena
from ..models.model import Model
from ..models.rows import drop_row, own_row, stack_rows, take_rows
from .profile import NO_CLOCK, FrameClock
from .rng import KeyRows, RandomStream
from .warm_start import WarmStart


class PrefillCancelled(RuntimeError):
    """The system-prompt prefill was stopped (the client left, or the server shuts down)."""


@dataclass
class Tokens:
    """A position's tokens of every row, possibly not yet evaluated."""

    text: mx.array  # (B,) int32
    ids: mx.array  # (B, 2) int32: text, function
    forced: list[bool]  # per row: the function id was forced, not predicted


@dataclass
class TimelineStep:
    """What one position produced for one row: host ids and the codes (evaluated by ``step``)."""

    index: int
    text_id: int
    function_id: int
    codes: mx.array  # (1, 1, Q) raw codes, control codes not yet replaced
    function_forced: bool = False  # ``function_id`` was forced, not predicted


class Timeline:
    """The speaking recurrence of ``B`` conversations, in mlx-lm's cache style.

    Per row: the Nemotron-H state (:class:`~..models.duplex.LanguageState`),
    the EAR-TTS backbone caches, the key stream of the TTS draws, the speech
    head's nucleus ``top_p`` (a session option; ``None``: the checkpoint's) and the
    position; over all rows: the previous text and function tokens
    (``(B, 1)``) and the previous codes (``(B, 1, Q)``). A conversation's own
    timeline has one row. :meth:`merge` makes one timeline of many rows for a
    position and :meth:`extract` takes a row back out (the per-row caches and
    key streams are the rows' own objects, updated in place; the token and
    code arrays are stacked and sliced). ``state`` lists every array,
    ``meta_state`` the host values that rebuild it (:meth:`from_state`); the
    ``state`` setter restores arrays into the same structure.
    """

    def __init__(self, model: Model, start: WarmStart, *, seed: int = 0,
                 use_language_cache: bool = True,
                 context: tuple[ContextWindow, ContextWindow] | None = None,
                 top_p: float | None = None):
        """``context``: the LLM's and the backbone's bounded contexts (``None``: unbounded);
        ``top_p``: the speech head's nucleus (``None``: the checkpoint's ``tts_config.top_p``)."""
        self._bind(model)
        self.top_p = [top_p]
        pad = mx.array([[self.config.pad_token_id]], dtype=mx.int32)
        language, speech = (None, None) if context is None else context
        self._set_rows([0], [model.stt_model.make_state(use_language_cache, language)],
                       [start.fresh_cache(speech)], [RandomStream(seed)],
                       (pad, pad, start.prev_codes))

    def _bind(self, model: Model) -> None:
        self.model = model
        self.config = model.config
        self._pad = mx.array([self.config.pad_token_id], dtype=mx.int32)
        silence = model.tts_model.codec_silence_tokens
        self._silence = silence.astype(mx.int32).reshape(1, 1, -1)

    def _set_rows(self, positions: list[int], language: list[LanguageState],
                  tts_caches: list[Any], rngs: list[RandomStream],
                  prev: Sequence[mx.array], keys: KeyRows | None = None) -> None:
        self.positions, self.language, self.tts_caches, self.rngs = positions, language, tts_caches, rngs
        self.keys = keys  # the rows' keys while stacked (their streams hold none)
        # The backbone's rings per layer while stacked (the rows' caches hold none).
        self.arenas: list[KVArena] | None = None
        self.prev_text, self.prev_function, self.prev_codes = prev

    @property
    def batch_size(self) -> int:
        return len(self.positions)

    # --- rows -------------------------------------------------------------------

    def _with(self, *rows: Any) -> "Timeline":
        """A timeline of the same model over the given rows (:meth:`_set_rows`' arguments)."""
        timeline = copy.copy(self)  # the same model and constants; the rows are set anew
        timeline._set_rows(*rows)
        return timeline

    @classmethod
    def merge(cls, rows: Sequence["Timeline"]) -> "Timeline":
        """One timeline of the rows' conversations, in order (one row: that row itself)."""
        if len(rows) == 1:
            return rows[0]
        merged = rows[0]._with(
            [p for t in rows for p in t.positions], [s for t in rows for s in t.language],
            [c for t in rows for c in t.tts_caches], [r for t in rows for r in t.rngs],
            [stack_rows([getattr(t, name) for t in rows])
             for name in ("prev_text", "prev_function", "prev_codes")],
            KeyRows.merge([p for t in rows for p in ([t.keys] if t.keys is not None else t.rngs)]),
        )
        merged.top_p = [p for t in rows for p in t.top_p]
        merged._stack([[p for t in rows for p in t._speech_parts(i)]
                       for i in range(len(rows[0].tts_caches[0]))])
        return merged

    def _speech_parts(self, layer: int) -> list[Any]:
        """The backbone layer's rings of every row in order: its arena (the first rows'),
        then the other rows' own caches."""
        stacked = self._arena_rows()
        return [*(self.arenas[layer:layer + 1] if stacked else ()),
                *(c[layer] for c in self.tts_caches[stacked:])]

    def _arena_rows(self) -> int:
        """How many rows the backbone's arenas hold: the first ones, or none."""
        return 0 if self.arenas is None else self.arenas[0].sessions

    def _stack(self, speech: list[list[Any]] | None = None) -> None:
        """Rows that are all ready step as one stacked state: the language states as
        :class:`LanguageRows`, the backbone's rings (``speech``, each layer's parts) as
        one :class:`KVArena` a layer for the rows that talk (each row's own caches give
        their arrays up). A fresh conversation at its first position (a joiner, after
        the rows that step already) neither talks nor is ready: its language state
        steps on its own beside the others' stack and its rings stay its own, so the
        others stay stacked as they were. Run when the rows change (:meth:`merge`) and
        after a position at which one became ready."""
        if self.batch_size < 2:
            return
        groups: list[LanguageState] = []  # consecutive ready states stacked as one
        for ready, states in groupby(self.language, key=self.model.stt_model.ready):
            states = list(states)
            groups += [LanguageRows(states)] if ready and len(states) > 1 else states
        self.language = groups
        if speech is None:
            if self._arena_rows() == self.batch_size:
                return
            speech = [self._speech_parts(i) for i in range(len(self.tts_caches[0]))]
        # The rows that talk stack when they come first (a row at its first position is
        # a joiner, after them, its rings its own parts); one arena alone is kept as it is.
        talking = sum(p > 0 for p in self.positions)
        parts = [layer[:len(layer) - self.batch_size + talking] for layer in speech]
        if talking > 1 and all(self.positions[:talking]) and all(
                KVArena.fits(p, GUIDED_ROWS) for p in parts):
            self.arenas = [p[0] if len(p) == 1 else KVArena.merge(p, GUIDED_ROWS) for p in parts]
        else:
            self.arenas = None
            for part in (p for layer in speech for p in layer if isinstance(p, KVArena)):
                part.split()

    def remove(self, index: int) -> "Timeline":
        """Row ``index`` as a one-row timeline of its own (copies, its rings out of their
        arenas); the other rows stay stacked as they are. A one-row timeline: itself."""
        if self.batch_size == 1:
            return self
        group, within = self._language_row(index)
        language = self.language[group]
        if isinstance(language, LanguageRows):
            row = language.remove(within)
            if len(language.rows) == 1:
                self.language[group] = language.extract(0)
        else:
            row = self.language.pop(group)
        caches, rng = self.tts_caches.pop(index), self.rngs.pop(index)
        if self.keys is not None:
            rng.key = self.keys.remove(index)
        stacked = self._arena_rows()
        if index < stacked:  # its rings are the arena's: copied out, the others kept
            rest = [b for b in range(stacked) if b != index]
            for arena in self.arenas:
                arena.extract(index)
                arena.extract(rest[0]) if len(rest) == 1 else arena.filter(rest)
            if len(rest) == 1:
                self.arenas = None
        own = self._with([self.positions.pop(index)], [row], [caches], [rng],
                         [own_row(a, index) for a in (self.prev_text, self.prev_function,
                                                      self.prev_codes)])
        own.top_p = [self.top_p.pop(index)]
        self.prev_text, self.prev_function, self.prev_codes = (
            drop_row(a, index) for a in (self.prev_text, self.prev_function, self.prev_codes))
        if self.keys is not None and self.batch_size == 1:  # the last row's key is its own again
            self.rngs[0].key, self.keys = self.keys.keys[0], None
        return own

    def _language_row(self, index: int) -> tuple[int, int]:
        """Which of :attr:`language`'s states holds row ``index``, and its row there."""
        for group, state in enumerate(self.language):
            if index < state.batch_size:
                return group, index
            index -= state.batch_size
        raise IndexError(f"row {index} is past the timeline's {self.batch_size} rows")

    # --- state ------------------------------------------------------------------

    def _parts(self) -> list[list[mx.array]]:
        if self.prev_codes is None:  # released
            return []
        return [*(s.state for s in self.language), *(cache_state(c) for c in self.tts_caches),
                *(a.state for a in self.arenas or ()),
                *(r.state if self.keys is None else [self.keys.keys[b]]
                  for b, r in enumerate(self.rngs)), [self.prev_text, self.prev_function, self.prev_codes]]

    @property
    def state(self) -> list[mx.array]:
        """Every array the recurrence carries (language and TTS caches, keys, previous tokens)."""
        return [a for part in self._parts() for a in part]

    @state.setter
    def state(self, value: list[mx.array]) -> None:
        self._set_rows(*self._rows_from_state(value, self.meta_state))

    def row_nbytes(self, index: int) -> int:
        """The bytes of row ``index``'s ``state`` (as :meth:`remove` of it would size them)."""
        group, within = self._language_row(index)
        language = self.language[group]
        return ((language.row_nbytes(within) if isinstance(language, LanguageRows)
                 else language.nbytes) + state_nbytes(self.tts_caches[index])
                + (sum(a.row_nbytes(index) for a in self.arenas)
                   if index < self._arena_rows() else 0)
                + (sum(a.nbytes for a in self.rngs[index].state) if self.keys is None
                   else self.keys.keys.nbytes // len(self.keys))
                + sum(a.nbytes // a.shape[0]
                      for a in (self.prev_text, self.prev_function, self.prev_codes)))

    @property
    def meta_state(self) -> tuple:
        """Positions, each part's array count, and the language and TTS caches' meta states."""
        return (tuple(self.positions), tuple(len(p) for p in self._parts()),
                tuple(s.meta_state for s in self.language),
                tuple(cache_meta_state(c) for c in self.tts_caches))

    @classmethod
    def from_state(cls, model: Model, state: list[mx.array], meta_state: tuple) -> "Timeline":
        """A timeline over ``state`` (as ``state`` lists it; it writes into these arrays)."""
        timeline = object.__new__(cls)
        timeline._bind(model)
        timeline._set_rows(*cls._rows_from_state(state, meta_state))
        timeline.top_p = [None] * timeline.batch_size  # a session option, not state
        return timeline

    @staticmethod
    def _rows_from_state(state: list[mx.array], meta_state: tuple) -> tuple:
        positions, counts, language, tts = meta_state
        rows = len(positions)
        parts = split_state(state, counts)
        return (list(positions),
                [LanguageState.from_state(parts[b], language[b]) for b in range(rows)],
                [caches_from_state(parts[rows + b], tts[b]) for b in range(rows)],
                [RandomStream.from_state(parts[2 * rows + b]) for b in range(rows)],
                parts[3 * rows])

    def release(self) -> None:
        """Drop every array the recurrence carries; the timeline is unusable afterwards."""
        for language in self.language:
            language.release()
        for rng in self.rngs:
            rng.state = []
        self.keys = self.arenas = None
        self.tts_caches = [[] for _ in self.tts_caches]
        self.prev_text = self.prev_function = self.prev_codes = None

    # --- one position -------------------------------------------------------------

    def prefill_steps(self, prompt_ids: list[int]) -> Iterator[int]:
        """Read system-prompt tokens on the audio channel, one position each (one row).

        Yields the positions still to read after each one, so a caller that
        serves other conversations between positions (the server's engine)
        bounds how long a prefill holds them up; every position is evaluated
        on its own either way, so the state is the same. The embeddings enter
        in float32, the dtype of the audio embeddings they stand in for (the
        reference's offline path does the same; its streaming path feeds them
        in bf16, see conformance/README.md). A caller that stops between two
        positions (closes the generator) leaves the timeline unusable.
        """
        if not prompt_ids:
            return
        if self.batch_size != 1:
            raise ValueError(f"a prefill reads one conversation's prompt, not {self.batch_size}")
        ids = mx.array([prompt_ids], dtype=mx.int32)
        prompt = self.model.stt_model.embed_tokens(ids).astype(mx.float32)
        for p in range(len(prompt_ids)):
            self.step(prompt[:, p : p + 1], generate=False)
            yield len(prompt_ids) - p - 1

    def listen(
        self,
        audio: mx.array,
        forced: Sequence[int | None] | None = None,
        *,
        generate: bool = True,
        clock: FrameClock = NO_CLOCK,
    ) -> Tokens:
        """The language half of a position, lazily: ``(B, 1, H)`` audio -> the rows' tokens.

        Row ``b`` of ``audio`` is row ``b``'s. ``forced[b]`` replaces its
        function head's prediction (teacher forcing, used to inject tool
        results): the forced id is this position's function token and the next
        position's previous-function input. ``generate=False`` reads a prompt
        position: the LLM advances, its heads are muted (pad on both channels).
        The fused inputs, the Mamba2/MLP runs and the heads take all rows at
        once and each row attends over its own KV cache, so every row's tokens
        equal that conversation's alone. Evaluate ``Tokens.ids`` (with any
        other work of the frame), then call :meth:`speak`.
        """
        stt = self.model.stt_model
        fused = stt.fuse(self.prev_text, audio, self.prev_function)
        text_logits, function_logits = stt.step(fused, self.language)
        rows = range(self.batch_size)
        if not generate:
            pad = mx.concatenate([self._pad for _ in rows])
            clock.stage("language", pad)
            return self._take(pad, pad, [False for _ in rows])
        text = mx.argmax(text_logits[:, -1], axis=-1).astype(mx.int32)
        predicted = mx.argmax(function_logits[:, -1], axis=-1).astype(mx.int32)
        forced = [None for _ in rows] if forced is None else list(forced)
        function = predicted if all(f is None for f in forced) else mx.concatenate(
            [predicted[b : b + 1] if force is None else mx.array([force], dtype=mx.int32)
             for b, force in enumerate(forced)])
        clock.stage("language", text, function)
        return self._take(text, function, [force is not None for force in forced])

    def _take(self, text: mx.array, function: mx.array, forced: list[bool]) -> Tokens:
        """This position's tokens (``(B,)`` each) become the next position's inputs."""
        self.prev_text = text[:, None]
        self.prev_function = function[:, None]
        return Tokens(text, mx.stack([text, function], axis=1), forced)

    def speak(self, tokens: Tokens, clock: FrameClock = NO_CLOCK) -> list[TimelineStep]:
        """The speech half, after ``tokens.ids`` was evaluated: each row's lazy codes.

        Every row past its first position advances EAR-TTS by one frame: the
        backbone and the depth head take all of them at once, each row with
        its own caches and key stream (:meth:`~..models.ear_tts.EarTTS.backbone_step`,
        :meth:`~..models.ear_tts.EarTTS.generate_codes`). A first position's
        codes are the codec's silence codes. The TTS text conditioning spells
        the text token on the host, which is why the language half is
        evaluated first. Evaluate the steps' ``codes`` (or all of them,
        ``self.codes``, ``(B, 1, Q)``) next.
        """
        ids = tokens.ids.tolist()
        rows = range(self.batch_size)
        codes = [self._silence for _ in rows]
        talking = [b for b in rows if self.positions[b] > 0]
        if talking:
            tts = self.model.tts_model.tts_model
            is_eos = (tokens.text == self.config.eos_token_id).reshape(-1, 1, 1)
            previous = mx.where(is_eos, self._silence, self.prev_codes)
            hidden = tts.backbone_step(take_rows(previous, talking),
                                       take_rows(tokens.text[:, None], talking),
                                       [self.tts_caches[b] for b in talking],
                                       [ids[b][0] for b in talking], self.arenas)
            mx.async_eval(hidden)  # computes while the depth loop is built
            clock.sub_stage("tts.backbone", hidden)
            keys: Any = [self.rngs[b] for b in talking]
            if self.keys is not None:
                keys = self.keys if len(talking) == self.batch_size else KeyRows(
                    take_rows(self.keys.keys, talking))
            made = tts.generate_codes(hidden, keys, [self.top_p[b] for b in talking])
            if isinstance(keys, KeyRows) and keys is not self.keys:
                self.keys.keys[mx.array(talking)] = keys.keys  # type: ignore[union-attr]
            clock.sub_stage("tts.mog_head", made)
            for j, b in enumerate(talking):
                codes[b] = made[j : j + 1]
            self.prev_codes = made if len(talking) == self.batch_size else mx.concatenate(
                [codes[b] if b in talking else self.prev_codes[b : b + 1] for b in rows])
        # Every row's codes as one array (the rows' ``codes`` are its slices).
        self.codes = made if len(talking) == self.batch_size else stack_rows(codes)
        steps = [TimelineStep(self.positions[b], *ids[b], codes[b], tokens.forced[b])
                 for b in rows]
        self.positions = [p + 1 for p in self.positions]
        if len(talking) < self.batch_size:  # a row's first position: it is ready now
            self._stack()
        return steps

    def step(
        self,
        audio: mx.array,
        forced: Sequence[int | None] | None = None,
        *,
        generate: bool = True,
        clock: FrameClock = NO_CLOCK,
    ) -> list[TimelineStep]:
        """Advance one position: :meth:`listen`, evaluate, :meth:`speak`, evaluate.

        Two host round trips: the token ids, then the codes (``clock`` may add
        stage barriers when profiling).
        """
        tokens = self.listen(audio, forced, generate=generate, clock=clock)
        mx.eval(tokens.ids)
        steps = self.speak(tokens, clock)
        mx.eval([step.codes for step in steps])
        clock.stage("tts")
        return steps
