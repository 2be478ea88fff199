"""RNNT branch: greedy transcript of the user's speech, one encoder frame at a time.

The prediction and joint networks are mlx-audio's nemotron_asr modules. The
greedy rule is the standard NeMo one: a blank advances time; a symbol updates
the prediction network and the same frame is tried again, at most
``max_symbols`` times.

:class:`GreedyRNNT` runs that rule without host round trips: every frame
unrolls all ``max_symbols`` tries as one fixed-shape compiled graph, where
each try's emission is a mask (``still emitting and not blank``) that selects
between the updated and the carried prediction state. The symbols come back
as an array, blank-padded after the first blank, so a frame costs no host
sync of its own; :class:`RNNTState` reads them when the caller has evaluated
them. The arithmetic per try is the eager loop's, so transcripts are identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.stt.models.nemotron_asr import tokenizer as sp_vocab
from mlx_audio.stt.models.nemotron_asr.rnnt import JointNetwork, PredictNetwork

from .weight_layout import RowMajorLSTM, layouts_agree, row_major

# (prediction [1, H], then per LSTM layer the proposed h [1, H], then each c [1, H])
Carry = tuple[mx.array, ...]


# Per LSTM layer: ``Wx`` and ``Wh`` in float32, stored transposed (``weight_layout``).
Held = list[tuple[mx.array, mx.array]]


def held_lstm(lstm: list[nn.LSTM]) -> Held | None:
    """Float32, transposed copies of each layer's weights, for the products that run in
    float32 (a bf16 layer meeting the float32 state); ``None`` where the layout would
    change their bits (:func:`~.weight_layout.layouts_agree`)."""
    if not layouts_agree(mx.float32):
        return None
    held = [(row_major(layer.Wx.astype(mx.float32)), row_major(layer.Wh.astype(mx.float32)))
            for layer in lstm]
    mx.eval(held)
    return held


class _HeldCache:
    """A decoder's held copies and the weight arrays they were made from."""

    def __init__(self, sources: list[mx.array], held: Held | None):
        self.sources, self.held = sources, held


def shared_held_lstm(decoder: PredictNetwork) -> Held | None:
    """:func:`held_lstm` of ``decoder``'s LSTM, made once per set of weights and kept on it
    (a plain attribute, outside the module tree), so sessions share one copy."""
    lstm = decoder.prediction["dec_rnn"].lstm
    sources = [w for layer in lstm for w in (layer.Wx, layer.Wh)]
    cached = getattr(decoder, "_held_lstm", None)
    if cached is None or len(cached.sources) != len(sources) or any(
        a is not b for a, b in zip(cached.sources, sources)
    ):
        cached = _HeldCache(sources, held_lstm(lstm))
        decoder._held_lstm = cached
    return cached.held


def _affine(c: mx.array | None, x: mx.array, w: mx.array, w32: mx.array | None) -> mx.array:
    """``mx.addmm(c, x, w.T)`` (``x @ w.T`` without ``c``), rounded as that op rounds.

    When the op runs in float32 (any operand is) and ``w32`` is given, the product
    takes ``w32`` and ``c`` is added after it, which is what float32 ``addmm`` on
    the stored layout does (``weight_layout``); otherwise the op itself runs.
    """
    if w32 is not None and mx.float32 in (x.dtype, w.dtype, None if c is None else c.dtype):
        y = x @ w32.T
        return y if c is None else y + c
    return x @ w.T if c is None else mx.addmm(c, x, w.T)


def lstm_step(lstm: list[nn.LSTM], x: mx.array, h: list[mx.array], c: list[mx.array],
              held: Held | None = None):
    """One time step of a stacked ``nn.LSTM``: ``x`` [1, in] -> (top output, h, c).

    The same operations, in the same order and rounding, as the layer's own
    ``__call__`` (``nn.LSTM``, or :class:`~.weight_layout.RowMajorLSTM`) on a
    one-step sequence, without its per-call reshapes and stacking; ``held``
    (:func:`held_lstm`) serves the float32 products without converting the
    weights every call.
    """
    new_h, new_c = [], []
    for index, (layer, hidden, cell) in enumerate(zip(lstm, h, c)):
        if held is not None:
            wx32, wh32 = held[index]
        else:  # a RowMajorLSTM's float32 weights are already transposed
            wx32, wh32 = (layer.Wx, layer.Wh) if isinstance(layer, RowMajorLSTM) else (None, None)
        ifgo = _affine(layer.bias, x, layer.Wx, wx32)
        ifgo = _affine(ifgo, hidden, layer.Wh, wh32)
        i, f, g, o = mx.split(ifgo, 4, axis=-1)
        i, f, g, o = mx.sigmoid(i), mx.sigmoid(f), mx.tanh(g), mx.sigmoid(o)
        cell = f * cell + i * g
        hidden = o * mx.tanh(cell)
        new_h.append(hidden)
        new_c.append(cell)
        x = hidden
    return x, new_h, new_c


class GreedyRNNT:
    """Branchless greedy decoding of one encoder frame; build one per model."""

    def __init__(
        self,
        decoder: PredictNetwork,
        joint: JointNetwork,
        blank_id: int,
        max_symbols: int,
    ):
        if max_symbols < 1:
            raise ValueError(f"max_symbols must be >= 1, got {max_symbols}")
        self.decoder = decoder
        self.joint = joint
        self.blank_id = blank_id
        self.max_symbols = max_symbols
        self.layers = decoder.prediction["dec_rnn"].num_layers
        self._held = shared_held_lstm(decoder)
        self._frame = mx.compile(partial(self._unrolled, self.max_symbols))
        self._first = mx.compile(partial(self._unrolled, 1))
        self._rest = mx.compile(partial(self._unrolled, self.max_symbols - 1))
        self._first_rows = mx.compile(partial(self._unrolled_rows, 1))
        self._rest_rows = mx.compile(partial(self._unrolled_rows, self.max_symbols - 1))

    def initial(self, dtype: mx.Dtype) -> Carry:
        """Prediction for the start symbol (blank: zero embedding, no LSTM state)."""
        prediction, (h, c) = self.decoder(None, None)
        return (
            prediction.reshape(1, -1).astype(dtype),
            *(h[i] for i in range(self.layers)),
            *(c[i] for i in range(self.layers)),
        )

    def _unrolled(self, tries: int, encoded: mx.array, prediction: mx.array, *state: mx.array):
        dtype = encoded.dtype
        joint, layers = self.joint, self.layers
        embed, lstm = self.decoder.prediction["embed"], self.decoder.prediction["dec_rnn"].lstm
        h, c = list(state[:layers]), list(state[layers:])
        # The joint's encoder projection does not change within a frame.
        enc = joint.enc(encoded.reshape(1, -1))
        active = mx.array(True)
        symbols = []
        for _ in range(tries):
            x = enc + joint.pred(prediction)
            for layer in joint.joint_net:
                x = layer(x)
            symbol = mx.argmax(x, axis=-1).astype(mx.int32)  # [1]
            emit = active & (symbol != self.blank_id)
            # The eager loop adopts the proposed state on emission, then runs
            # the prediction network on the emitted symbol.
            out, new_h, new_c = lstm_step(
                lstm, embed(symbol), [a.astype(dtype) for a in h], [a.astype(dtype) for a in c],
                self._held,
            )
            prediction = mx.where(emit, out.astype(dtype), prediction)
            h = [mx.where(emit, new, old) for new, old in zip(new_h, h)]
            c = [mx.where(emit, new, old) for new, old in zip(new_c, c)]
            symbols.append(mx.where(emit, symbol, self.blank_id))
            active = emit
        return mx.concatenate(symbols), prediction, *h, *c

    def _unrolled_rows(self, tries: int, encoded: mx.array, prediction: mx.array,
                       *state: mx.array):
        """:meth:`_unrolled` for ``B`` streams at once: ``encoded`` ``[B, 1, D]``, the
        carries stacked on the first axis; row ``b`` is stream ``b``'s own try for try
        (the same arithmetic, each row's emission masking only its row)."""
        dtype = encoded.dtype
        joint, layers = self.joint, self.layers
        embed, lstm = self.decoder.prediction["embed"], self.decoder.prediction["dec_rnn"].lstm
        h, c = list(state[:layers]), list(state[layers:])
        enc = joint.enc(encoded.reshape(encoded.shape[0], -1))
        active = mx.ones((encoded.shape[0], 1), dtype=mx.bool_)
        symbols = []
        for _ in range(tries):
            x = enc + joint.pred(prediction)
            for layer in joint.joint_net:
                x = layer(x)
            symbol = mx.argmax(x, axis=-1).astype(mx.int32)  # [B]
            emit = active & (symbol != self.blank_id)[:, None]
            out, new_h, new_c = lstm_step(
                lstm, embed(symbol), [a.astype(dtype) for a in h], [a.astype(dtype) for a in c],
                self._held,
            )
            prediction = mx.where(emit, out.astype(dtype), prediction)
            h = [mx.where(emit, new, old) for new, old in zip(new_h, h)]
            c = [mx.where(emit, new, old) for new, old in zip(new_c, c)]
            symbols.append(mx.where(emit[:, 0], symbol, self.blank_id))
            active = emit
        return mx.stack(symbols, axis=1), prediction, *h, *c

    def first_batch(self, encoded: mx.array, carries: list[Carry]) -> tuple[mx.array, list[Carry]]:
        """:meth:`first` of ``B`` streams in one call: ``[B, 1]`` symbols and each carry."""
        return self._rows(self._first_rows, encoded, carries)

    def rest_batch(self, encoded: mx.array, carries: list[Carry]) -> tuple[mx.array, list[Carry]]:
        """:meth:`rest` of ``B`` streams in one call: ``[B, max_symbols - 1]`` symbols."""
        return self._rows(self._rest_rows, encoded, carries)

    @staticmethod
    def _rows(graph, encoded: mx.array, carries: list[Carry]) -> tuple[mx.array, list[Carry]]:
        stacked = [mx.concatenate(parts) for parts in zip(*carries)]
        symbols, *updated = graph(encoded, *stacked)
        rows = [tuple(a[b : b + 1] for a in updated) for b in range(len(carries))]
        return symbols, rows

    def frame(self, encoded: mx.array, carry: Carry) -> tuple[mx.array, Carry]:
        """``(1, 1, d_model)`` frame -> lazy ``(max_symbols,)`` symbols and the new carry."""
        return _run(self._frame, encoded, carry)

    def first(self, encoded: mx.array, carry: Carry) -> tuple[mx.array, Carry]:
        """The frame's first try only: lazy ``(1,)`` symbol and the carry after it.

        A blank ends the frame; otherwise :meth:`rest` runs the remaining
        tries. Split so, the caller reads the first symbol where it syncs
        anyway and skips the rest on blank frames (most frames of real speech);
        the arithmetic is :meth:`frame`'s, try for try.
        """
        return _run(self._first, encoded, carry)

    def rest(self, encoded: mx.array, carry: Carry) -> tuple[mx.array, Carry]:
        """Tries 2 .. ``max_symbols`` after a first try that emitted."""
        return _run(self._rest, encoded, carry)


def _run(graph, encoded: mx.array, carry: Carry) -> tuple[mx.array, Carry]:
    symbols, *updated = graph(encoded, *carry)
    return symbols, tuple(updated)


@dataclass
class RNNTState:
    """One stream's greedy state: the device carry and the host transcript."""

    greedy: GreedyRNNT | None
    vocabulary: list[str]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    _carry: Carry | None = None
    # SentencePiece decoding is piece-wise concatenation, so the transcript
    # grows by each new piece's text instead of re-decoding every token.
    _raw: str = ""
    _encoded: mx.array | None = None  # the frame whose first try ran

    @property
    def enabled(self) -> bool:
        return self.greedy is not None and bool(self.vocabulary)

    def advance(self, encoded: mx.array) -> mx.array | None:
        """Queue one frame (lazily); returns its symbols to evaluate, then :meth:`commit`."""
        if not self.enabled:
            return None
        assert self.greedy is not None
        if self._carry is None:
            self._carry = self.greedy.initial(encoded.dtype)
        symbols, self._carry = self.greedy.frame(encoded, self._carry)
        return symbols

    def advance_first(self, encoded: mx.array) -> mx.array | None:
        """Queue the frame's first try; evaluate it, then :meth:`advance_rest`."""
        if not self.enabled:
            return None
        assert self.greedy is not None
        if self._carry is None:
            self._carry = self.greedy.initial(encoded.dtype)
        self._encoded = encoded
        first, self._carry = self.greedy.first(encoded, self._carry)
        return first

    @staticmethod
    def advance_first_batch(states: list["RNNTState"], encoded: list[mx.array]
                            ) -> list[mx.array | None]:
        """:meth:`advance_first` of many streams of one model, the enabled ones in one call."""
        on = [b for b, s in enumerate(states) if s.enabled]
        if len(on) < 2:
            return [s.advance_first(e) for s, e in zip(states, encoded)]
        greedy = states[on[0]].greedy
        assert greedy is not None
        for b in on:
            state = states[b]
            if state._carry is None:
                state._carry = greedy.initial(encoded[b].dtype)
            state._encoded = encoded[b]
        symbols, carries = greedy.first_batch(mx.concatenate([encoded[b] for b in on]),
                                              [states[b]._carry for b in on])
        firsts: list[mx.array | None] = [None] * len(states)
        for j, b in enumerate(on):
            states[b]._carry = carries[j]
            firsts[b] = symbols[j]
        return firsts

    @staticmethod
    def advance_rest_batch(states: list["RNNTState"], firsts: list[mx.array | None]
                           ) -> list[mx.array | None]:
        """:meth:`advance_rest` of many streams; the ones whose first try emitted in one call."""
        more = [b for b, (s, f) in enumerate(zip(states, firsts))
                if f is not None and s.greedy is not None and s.greedy.max_symbols > 1
                and f.item() != s.greedy.blank_id]
        if len(more) < 2:
            return [s.advance_rest(f) for s, f in zip(states, firsts)]
        greedy = states[more[0]].greedy
        assert greedy is not None
        rest, carries = greedy.rest_batch(mx.concatenate([states[b]._encoded for b in more]),
                                          [states[b]._carry for b in more])
        out = list(firsts)
        for j, b in enumerate(more):
            states[b]._carry = carries[j]
            out[b] = mx.concatenate([firsts[b], rest[j]])
        return out

    def advance_rest(self, first: mx.array | None) -> mx.array | None:
        """After the evaluated first try: the frame's other tries, if it emitted.

        Returns the frame's symbols (lazy when more tries were queued).
        """
        if first is None:
            return None
        assert self.greedy is not None
        if self.greedy.max_symbols == 1 or first.item() == self.greedy.blank_id:
            return first
        rest, self._carry = self.greedy.rest(self._encoded, self._carry)
        return mx.concatenate([first, rest])

    @property
    def state(self) -> list[mx.array]:
        """The carried state, to evaluate with the symbols."""
        return [] if self._carry is None else list(self._carry)

    def release(self) -> None:
        """Drop the device carry (the transcript stays readable)."""
        self._carry = self._encoded = None

    def commit(self, symbols: mx.array | None) -> str | None:
        """Read evaluated symbols into the transcript; return the new text delta.

        Returns ``None`` when no visible symbol was emitted.
        """
        if symbols is None:
            return None
        assert self.greedy is not None
        blank = self.greedy.blank_id
        before = len(self.tokens)
        for symbol in symbols.tolist():
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
        return delta


def transcribe(encoded: mx.array, state: RNNTState, chunk: int = 25) -> str | None:
    """Greedy-decode every frame of ``(1, T, d_model)`` ``encoded`` into ``state``.

    Frames are queued lazily and evaluated ``chunk`` at a time.
    """
    if not state.enabled:
        return None
    pending: list[mx.array] = []
    for t in range(encoded.shape[1]):
        pending.append(state.advance(encoded[:, t : t + 1]))
        if len(pending) == chunk or t == encoded.shape[1] - 1:
            mx.eval(*pending, *state.state)
            for symbols in pending:
                state.commit(symbols)
            pending = []
    return state.text
