"""RNNT branch: greedy transcript of the user's speech, one encoder frame at a time.

The prediction and joint networks are mlx-audio's nemotron_asr modules. The
greedy rule (blank advances time; at most ``max_symbols`` symbols a frame) is
the standard NeMo one; ``RNNTState.step`` is shared by offline and streaming.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_audio.stt.models.nemotron_asr import tokenizer as sp_vocab
from mlx_audio.stt.models.nemotron_asr.rnnt import JointNetwork, PredictNetwork


@dataclass
class RNNTState:
    """Greedy decoder state: last emitted symbol, LSTM state and transcript."""

    blank_id: int
    max_symbols: int
    vocabulary: list[str]
    last_token: int = -1
    hidden: tuple[mx.array, mx.array] | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    # Host round trips (one per joint argmax) made by the last ``step``.
    syncs: int = 0
    # Prediction-network output for (last_token, hidden); it only changes when a
    # symbol is emitted, so blank frames reuse it instead of re-running the LSTM.
    _prediction: mx.array | None = None
    _proposed: tuple[mx.array, mx.array] | None = None

    def __post_init__(self) -> None:
        if self.last_token < 0:
            self.last_token = self.blank_id

    @property
    def enabled(self) -> bool:
        return bool(self.vocabulary)

    def step(
        self, decoder: PredictNetwork, joint: JointNetwork, encoded: mx.array
    ) -> str | None:
        """Consume one ``(1, 1, d_model)`` encoder frame; return the new text delta.

        Returns ``None`` when no visible symbol was emitted.
        """
        if not self.enabled:
            return None
        emitted = 0
        self.syncs = 0
        before = len(self.tokens)
        while emitted < self.max_symbols:
            if self._prediction is None:
                token = (
                    None
                    if self.last_token == self.blank_id
                    else mx.array([[self.last_token]], dtype=mx.int32)
                )
                prediction, proposed = decoder(token, self.hidden)
                self._prediction = prediction.astype(encoded.dtype)
                self._proposed = proposed
            logits = joint(encoded, self._prediction)
            symbol = int(mx.argmax(logits))
            self.syncs += 1
            if symbol == self.blank_id:
                break
            self.last_token = symbol
            assert self._proposed is not None
            self.hidden = (
                self._proposed[0].astype(encoded.dtype),
                self._proposed[1].astype(encoded.dtype),
            )
            self._prediction = None
            if not sp_vocab.is_special_token(symbol, self.vocabulary):
                self.tokens.append(symbol)
            emitted += 1
        if len(self.tokens) == before:
            return None
        text = sp_vocab.decode(self.tokens, self.vocabulary).strip()
        delta = text[len(self.text) :] if text.startswith(self.text) else text
        self.text = text
        return delta


def transcribe(
    decoder: PredictNetwork,
    joint: JointNetwork,
    encoded: mx.array,
    state: RNNTState,
) -> str | None:
    """Greedy-decode every frame of ``(1, T, d_model)`` ``encoded`` into ``state``."""
    if not state.enabled:
        return None
    for t in range(encoded.shape[1]):
        state.step(decoder, joint, encoded[:, t : t + 1])
    return state.text
