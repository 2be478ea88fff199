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

import mlx.core as mx
from mlx_audio.stt.models.nemotron_asr import tokenizer as sp_vocab
from mlx_audio.stt.models.nemotron_asr.rnnt import JointNetwork, PredictNetwork

# (prediction [1, 1, H], proposed LSTM state h [L, 1, H], c [L, 1, H])
Carry = tuple[mx.array, mx.array, mx.array]


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
        # The module state is an input, so later weight updates are seen.
        self._frame = mx.compile(self._unrolled, inputs=[decoder.state, joint.state])

    def initial(self, dtype: mx.Dtype) -> Carry:
        """Prediction for the start symbol (blank: zero embedding, zero LSTM state)."""
        prediction, (h, c) = self.decoder(None, None)
        return prediction.astype(dtype), h, c

    def _unrolled(self, encoded: mx.array, prediction: mx.array, h: mx.array, c: mx.array):
        dtype = encoded.dtype
        joint = self.joint
        enc = mx.expand_dims(joint.enc(encoded), 2)
        active = mx.array(True)
        symbols = []
        for _ in range(self.max_symbols):
            x = enc + mx.expand_dims(joint.pred(prediction), 1)
            for layer in joint.joint_net:
                x = layer(x)
            symbol = mx.argmax(x.reshape(1, -1), axis=-1).astype(mx.int32)[None]  # [1, 1]
            emit = active & (symbol != self.blank_id)
            # The eager loop adopts the proposed state on emission, then runs
            # the prediction network on the emitted symbol.
            updated, (new_h, new_c) = self.decoder(symbol, (h.astype(dtype), c.astype(dtype)))
            prediction = mx.where(emit, updated.astype(dtype), prediction)
            h = mx.where(emit, new_h, h)
            c = mx.where(emit, new_c, c)
            symbols.append(mx.where(emit, symbol, self.blank_id).reshape(1))
            active = emit
        return mx.concatenate(symbols), prediction, h, c

    def frame(self, encoded: mx.array, carry: Carry) -> tuple[mx.array, Carry]:
        """``(1, 1, d_model)`` frame -> lazy ``(max_symbols,)`` symbols and the new carry."""
        symbols, *updated = self._frame(encoded, *carry)
        return symbols, tuple(updated)


@dataclass
class RNNTState:
    """One stream's greedy state: the device carry and the host transcript."""

    greedy: GreedyRNNT | None
    vocabulary: list[str]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    _carry: Carry | None = None

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

    def arrays(self) -> list[mx.array]:
        """The carried state, to evaluate with the symbols."""
        return [] if self._carry is None else list(self._carry)

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
        if len(self.tokens) == before:
            return None
        text = sp_vocab.decode(self.tokens, self.vocabulary).strip()
        delta = text[len(self.text) :] if text.startswith(self.text) else text
        self.text = text
        return delta

    def step(self, encoded: mx.array) -> str | None:
        """One frame with its own evaluation (one host sync)."""
        symbols = self.advance(encoded)
        if symbols is not None:
            mx.eval(symbols, *self.arrays())
        return self.commit(symbols)


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
            mx.eval(*pending, *state.arrays())
            for symbols in pending:
                state.commit(symbols)
            pending = []
    return state.text
