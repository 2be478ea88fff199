"""RNNT branch: greedy transcript of the user's speech, one encoder frame at a time.

The prediction and joint networks are mlx-audio's nemotron_asr modules. The
greedy rule is the standard NeMo one: a blank advances time; a symbol updates
the prediction network and the same frame is tried again, at most
``max_symbols`` times.

:class:`GreedyRNNT` runs that rule without host round trips: a frame unrolls
its tries as one fixed-shape compiled graph, where each try's emission is a
mask (``still emitting and not blank``) that selects between the updated and
the carried prediction state. It takes ``B`` streams at once, each row masked
by its own emissions, so a row's arithmetic is the eager loop's and its
transcript is identical; one stream is ``B = 1``.

State follows mlx-lm's cache convention. :class:`RNNTCarry` is the device
carry of ``B`` streams (``state`` lists its arrays; ``merge`` stacks streams'
carries, ``extract`` hands a row back). :class:`RNNTState` is one stream: its
carry and its host transcript. A frame of many streams (:class:`RNNTFrame`)
runs the tries on their stacked carry in place (its caller keeps it stacked
between frames); the streams keep their transcripts, host books that do not
stack. One stream is the same code with ``B = 1``, where merging and
extracting move no data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.nemotron_asr import tokenizer as sp_vocab
from mlx_audio.stt.models.nemotron_asr.rnnt import JointNetwork, PredictNetwork

from .prediction_step import lstm_step, shared_derived
from ..remembered import ProbeVerdicts
from ..rows import own_row, stack_rows


class RNNTCarry:
    """The prediction network's carry of ``B`` streams: ``[prediction, h_1.., c_1..]``, each
    ``[B, H]``. ``merge`` stacks streams' carries, ``extract(i)`` hands row ``i`` back (one
    stream is ``B = 1``: both move no data)."""

    def __init__(self, arrays: list[mx.array]):
        self.arrays = list(arrays)

    @property
    def state(self) -> list[mx.array]:
        return list(self.arrays)

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        self.arrays = list(arrays)

    @property
    def batch_size(self) -> int:
        return self.arrays[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    @classmethod
    def merge(cls, carries: list["RNNTCarry"]) -> "RNNTCarry":
        """One carry whose rows are ``carries``' rows, in order (one carry: itself)."""
        if len(carries) == 1:
            return carries[0]
        return cls([stack_rows(parts) for parts in zip(*(c.arrays for c in carries))])

    def extract(self, index: int, copy: bool = True) -> "RNNTCarry":
        """Row ``index`` as a one-stream carry (a one-row carry: itself; ``copy=False``:
        slices, for a row stacked again)."""
        if self.batch_size == 1:
            return self
        return RNNTCarry([own_row(a, index, copy) for a in self.arrays])


class GreedyRNNT:
    """Branchless greedy decoding of ``B`` streams' encoder frames; build one per model."""

    def __init__(
        self,
        decoder: PredictNetwork,
        joint: JointNetwork,
        blank_id: int,
        max_symbols: int,
        hold_f32: bool = True,
    ):
        """``hold_f32``: whether the LSTM's float32 products use held float32 copies of
        its weights (the memory plan's choice; exact either way)."""
        if max_symbols < 1:
            raise ValueError(f"max_symbols must be >= 1, got {max_symbols}")
        self.decoder = decoder
        self.joint = joint
        self.blank_id = blank_id
        self.max_symbols = max_symbols
        self.layers = decoder.prediction["dec_rnn"].num_layers
        derived = shared_derived(decoder, ProbeVerdicts.default(), hold_f32)
        self._held, self._inputs = derived.held, derived.inputs
        self._graphs: dict[int, Callable] = {}  # tries -> compiled graph

    def initial(self, dtype: mx.Dtype) -> RNNTCarry:
        """One stream's carry for the start symbol (blank: zero embedding, no LSTM state)."""
        prediction, (h, c) = self.decoder(None, None)
        return RNNTCarry([
            prediction.reshape(1, -1).astype(dtype),
            *(h[i] for i in range(self.layers)),
            *(c[i] for i in range(self.layers)),
        ])

    def _unrolled(self, tries: int, encoded: mx.array, active: mx.array, prediction: mx.array,
                  *state: mx.array):
        """``tries`` greedy tries of ``B`` streams: ``encoded`` ``[B, 1, D]``, ``active``
        ``[B, 1]`` (a row that is not active emits nothing and keeps its carry), the
        carries stacked on the first axis; each row's emission masks only its row."""
        dtype = encoded.dtype
        joint, layers = self.joint, self.layers
        embed, lstm = self.decoder.prediction["embed"], self.decoder.prediction["dec_rnn"].lstm
        h, c = list(state[:layers]), list(state[layers:])
        # The joint's encoder projection does not change within a frame.
        enc = joint.enc(encoded.reshape(encoded.shape[0], -1))
        symbols, emitted = [], []
        for _ in range(tries):
            x = enc + joint.pred(prediction)
            for layer in joint.joint_net:
                x = layer(x)
            # argmax's own uint32 ids throughout (one cast at the end, not one a try);
            # logical_and fuses with the comparison (a bitwise and does not).
            symbol = mx.argmax(x, axis=-1)  # [B]
            emit = mx.logical_and(active, symbol[:, None] != self.blank_id)
            # The eager loop adopts the proposed state on emission, then runs
            # the prediction network on the emitted symbol.
            table = self._inputs
            out, new_h, new_c = lstm_step(
                lstm, None if table is not None else embed(symbol),
                [a.astype(dtype) for a in h], [a.astype(dtype) for a in c],
                self._held, None if table is None else table[symbol],
            )
            prediction = mx.where(emit, out.astype(dtype), prediction)
            h = [mx.where(emit, new, old) for new, old in zip(new_h, h)]
            c = [mx.where(emit, new, old) for new, old in zip(new_c, c)]
            symbols.append(symbol)
            emitted.append(emit)
            active = emit
        # Blank where a row did not emit: one select over every try, at the end.
        symbols = mx.where(mx.concatenate(emitted, axis=1), mx.stack(symbols, axis=1),
                           self.blank_id)
        return symbols.astype(mx.int32), prediction, *h, *c

    def __call__(self, encoded: mx.array, carry: RNNTCarry, tries: int,
                 active: list[bool] | None = None) -> mx.array:
        """``tries`` tries of ``(B, 1, d_model)`` frames from ``carry`` (updated in place):
        lazy ``(B, tries)`` symbols, blank after a row's first blank.

        The frame's first try alone (``tries=1``), then the other
        ``max_symbols - 1`` after an emission, is the whole frame
        (``max_symbols``) try for try: the split lets a caller read the first
        symbol where it syncs anyway and skip the rest on blank frames.
        ``active`` (host flags, one per row; default all): rows that take the
        tries; the others emit blanks and keep their carry bit for bit, so the
        rest of a frame runs on every row in one fixed shape (one graph per
        batch size, whichever rows emitted).
        """
        graph = self._graphs.get(tries)
        if graph is None:
            graph = self._graphs[tries] = mx.compile(partial(self._unrolled, tries))
        rows = encoded.shape[0]
        flags = np.ones((rows, 1), dtype=bool) if active is None else \
            np.asarray(active, dtype=bool).reshape(rows, 1)
        symbols, *updated = graph(encoded, mx.array(flags), *carry.state)
        carry.state = updated
        return symbols

    def warm(self, batch_sizes: list[int], width: int, dtype: mx.Dtype) -> None:
        """Trace (and, on a backend that builds kernels, build) the frame's graphs for
        each batch size: the first try and the later tries, which a silent warm-up
        never reaches (nothing is emitted). ``width``: the encoder's ``d_model``."""
        for batch in batch_sizes:
            carry = RNNTCarry.merge([self.initial(dtype) for _ in range(batch)])
            encoded = mx.zeros((batch, 1, width), dtype=dtype)
            symbols = [self(encoded, carry, 1)]
            if self.max_symbols > 1:
                symbols.append(self(encoded, carry, self.max_symbols - 1, [True] * batch))
            mx.eval(symbols, carry.state)


@dataclass
class RNNTState:
    """One stream's greedy state: the device carry and the host transcript."""

    greedy: GreedyRNNT | None
    vocabulary: list[str]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    carry: RNNTCarry | None = None
    # SentencePiece decoding is piece-wise concatenation, so the transcript
    # grows by each new piece's text instead of re-decoding every token.
    _raw: str = ""
    # Bounded (a conversation of any length): past twice ``keep_chars`` the
    # transcript keeps its last ``keep_chars`` characters and ``tokens`` as many
    # tokens; ``None`` keeps everything (a file's transcription).
    keep_chars: int | None = None

    @property
    def enabled(self) -> bool:
        return self.greedy is not None and bool(self.vocabulary)

    @property
    def state(self) -> list[mx.array]:
        """The carried arrays, to evaluate with the symbols."""
        return [] if self.carry is None else self.carry.state

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        self.carry = RNNTCarry(arrays) if arrays else None

    @property
    def nbytes(self) -> int:
        """The bytes of ``state`` (sized without slicing a carry shared with its batch)."""
        return 0 if self.carry is None else self.carry.nbytes

    def begin(self, dtype: mx.Dtype) -> RNNTCarry:
        """The carry the next frame starts from (the start symbol's, on the first)."""
        if self.carry is None:
            self.carry = self.greedy.initial(dtype)
        return self.carry

    def advance(self, encoded: mx.array) -> mx.array | None:
        """Queue one ``(1, 1, D)`` frame, all ``max_symbols`` tries (lazily); returns its
        ``(max_symbols,)`` symbols to evaluate with :attr:`state`, then :meth:`commit`."""
        if not self.enabled:
            return None
        symbols = self.greedy(encoded, self.begin(encoded.dtype), self.greedy.max_symbols)
        return symbols[0]

    def release(self) -> None:
        """Drop the device carry (the transcript stays readable)."""
        self.carry = None

    def commit(self, symbols: list[int] | mx.array | None) -> str | None:
        """Read a frame's symbols (host ints, or an evaluated array) into the transcript;
        return the new text delta, or ``None`` when no visible symbol was emitted."""
        if symbols is None:
            return None
        blank = self.greedy.blank_id
        before = len(self.tokens)
        for symbol in symbols.tolist() if isinstance(symbols, mx.array) else symbols:
            if symbol == blank:
                break
            if not sp_vocab.is_special_token(symbol, self.vocabulary):
                self.tokens.append(symbol)
                self._raw += sp_vocab.decode([symbol], self.vocabulary)
        if len(self.tokens) == before:
            return None
        text = self._raw.strip()
        delta = text[len(self.text) :] if text.startswith(self.text) else text
        self.text = text
        if self.keep_chars is not None and len(text) > 2 * self.keep_chars:
            self._bound(self.keep_chars)
        return delta

    def _bound(self, keep: int) -> None:
        """Keep the last ``keep`` characters (cut where no space starts, so the next
        ``strip`` keeps them as they are) and as many tokens."""
        cut = len(self.text) - keep
        while cut < len(self.text) and self.text[cut].isspace():
            cut += 1
        lead = len(self._raw) - len(self._raw.lstrip())
        self._raw = self._raw[lead + cut :]
        self.text = self.text[cut:]
        del self.tokens[: max(len(self.tokens) - keep, 0)]


class RNNTFrame:
    """One frame of ``B`` streams' greedy decoding, split at the first try.

    ``carry`` is the ``B`` streams' stacked carry (:meth:`RNNTCarry.merge`;
    a stream's own for ``B = 1``), updated in place. Construction queues every
    first try as one graph; evaluate :attr:`arrays` (with the frame's other
    first-evaluation work), then :meth:`rest` queues the other tries of the
    streams whose first try emitted, as one graph; evaluate what it returns,
    then :meth:`symbols` reads each stream's symbols from the evaluated arrays
    (no wait). A blank first try (most frames of real speech) ends its
    stream's frame there. The streams' transcripts are host books that stay
    with them (:meth:`RNNTState.commit`).
    """

    def __init__(self, greedy: GreedyRNNT, carry: RNNTCarry, encoded: mx.array):
        self.greedy, self.carry, self.encoded = greedy, carry, encoded
        self.more: mx.array | None = None
        self.emitted: list[int] = []  # rows whose first try emitted
        self.heard: list[list[int]] = []  # the first tries, read on the host
        self.first = greedy(encoded, carry, 1)

    @property
    def arrays(self) -> list[mx.array]:
        """The first tries and the carry after them."""
        return [self.first, *self.carry.arrays]

    def rest(self) -> list[mx.array]:
        """After :attr:`arrays` were evaluated: queue the tries after an emission; the
        arrays to evaluate (none when no first try emitted)."""
        greedy, carry = self.greedy, self.carry
        self.heard = self.first.tolist()  # evaluated: no wait
        if greedy.max_symbols > 1:
            self.emitted = [j for j, (s,) in enumerate(self.heard) if s != greedy.blank_id]
        if self.emitted:
            # Every row in one fixed shape, the rows that did not emit held (active
            # False): no regrouping, and one compiled graph per batch size.
            emitted = set(self.emitted)
            self.more = greedy(self.encoded, carry, greedy.max_symbols - 1,
                               [j in emitted for j in range(len(self.heard))])
        return [] if self.more is None else [self.more, *carry.arrays]

    def symbols(self) -> list[list[int]]:
        """After :meth:`rest`'s arrays were evaluated: each row's symbols of the frame."""
        out = [list(first) for first in self.heard]
        if self.more is not None:
            more = self.more.tolist()
            for j in self.emitted:
                out[j] += more[j]
        return out
