"""How fixture tensors are drawn: one seeded generator per tensor name, and the tuning knobs.

Each tensor has its own generator (seeded by ``seed`` and its name, so adding
a tensor never shifts another); linear weights are scaled by
``1/sqrt(fan_in)`` and norms start near identity (:class:`Tensors`). A few
biases are shaped (:class:`Tuning`, along the residual directions of
:class:`Directions`) so that offline decoding of a short synthetic signal
emits pad, EOS and ordinary text tokens, a mostly-pad function channel and
both blank and non-blank RNNT symbols.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Tuning:
    """Knobs that make the random model's greedy outputs varied.

    The language model carries three orthonormal directions of its residual
    stream: ``pad`` and ``eos`` (read by the text head's pad / EOS rows) and
    ``quiet`` (read by the function head's pad row). Every audio embedding holds
    a constant ``quiet`` offset, so the function channel is mostly pad. Ordinary
    text tokens fall into three classes by id; their embeddings point along
    ``pad``, ``eos`` or against ``quiet``, so the token emitted after them is
    pad, EOS, or an ordinary token with a non-pad function token (as after
    EOS). The greedy text stream then cycles through all of them, for any seed,
    because each decision has a margin of several logits.
    """

    # Offset along ``quiet`` in every audio embedding, per channel.
    audio_bias: float = 1.25
    # Feedback of ordinary-token embeddings along their class direction, per channel.
    feedback: float = 1.5
    # Logit gain of the text pad / EOS rows and the function pad row.
    text_boost: float = 8.0
    function_boost: float = 8.0
    # Fraction of their random part the boosted head rows keep.
    special_jitter: float = 0.5
    # Gain of the Nemotron-H mixer output projections (residual branch size).
    mixer_out_gain: float = 0.5
    # Bias of the blank class in the RNNT joint output layer.
    rnnt_blank_bias: float = 0.0
    # Gain of the joint's prediction projection (how much the history matters)
    # and of its blank row (how much blank varies with frame and history).
    rnnt_pred_gain: float = 6.0
    rnnt_blank_gain: float = 4.0
    # Mean log-magnitude of the codec's decoded spectrum (keeps the audio quiet).
    codec_log_magnitude: float = -5.0


# The RNNT branch is tuned per size for seed 0 (its blank/emit balance depends
# on the encoder's random features); the text and function channels need not be.
TUNINGS: dict[str, Tuning] = {
    "tiny": Tuning(),
    "small": Tuning(rnnt_pred_gain=2.0, rnnt_blank_bias=4.0),
}


class Tensors:
    """Accumulates named tensors; one seeded generator per name.

    ``device=True`` (the ``full`` size) draws the large tensors (every
    :meth:`normal`, and the language model's embedding and heads) with
    ``mx.random`` on the default device, one key per name, lazily, instead
    of numpy on the host; small tuned tensors still come from numpy.

    ``sink``: where each finished tensor goes, as soon as it is put (a shard
    writer that quantizes and evaluates it: no more than one tensor's graph is
    ever pending); without one, tensors collect in :attr:`arrays`. A tensor is
    put once, final: nothing reads or replaces it after.
    """

    def __init__(self, seed: int, device: bool = False,
                 sink: Callable[[str, mx.array], None] | None = None):
        self.seed = seed
        self.device = device
        self.sink = sink
        self.arrays: dict[str, mx.array] = {}
        self._names: set[str] = set()

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def key(self, name: str) -> mx.array:
        return mx.random.key((self.seed << 32) | zlib.crc32(name.encode()))

    def standard_normal(self, name: str, shape: tuple[int, ...]) -> mx.array:
        """A float32 standard normal draw on the device (``device`` mode)."""
        return mx.random.normal(shape, key=self.key(name))

    def put(self, name: str, value: np.ndarray, dtype: mx.Dtype = mx.bfloat16) -> None:
        if name in self._names:
            raise KeyError(f"duplicate tensor {name}")
        self._names.add(name)
        array = mx.array(value).astype(dtype)
        if self.sink is None:
            self.arrays[name] = array
        else:
            self.sink(name, array)

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> np.ndarray | mx.array:
        if self.device:
            value = self.standard_normal(name, shape) * std
        else:
            value = self.rng(name).standard_normal(shape).astype(np.float32) * std
        self.put(name, value)
        return value

    def linear(self, name: str, out_dim: int, in_dim: int, bias: bool = False,
               gain: float = 1.0) -> None:
        self.normal(f"{name}.weight", (out_dim, in_dim), gain / math.sqrt(in_dim))
        if bias:
            self.normal(f"{name}.bias", (out_dim,), 0.02)

    def conv(self, name: str, shape: tuple[int, ...], bias: bool = False,
             fan_in: int | None = None) -> None:
        fan_in = fan_in or int(np.prod(shape[1:]))
        self.normal(f"{name}.weight", shape, 1.0 / math.sqrt(fan_in))
        if bias:
            self.normal(f"{name}.bias", (shape[0],), 0.02)

    def norm(self, name: str, dim: int, *, offset: bool = False, bias: bool = False) -> None:
        """A norm weight near identity: ~1, or ~0 for ``1 + w`` (Gemma) norms."""
        value = self.rng(f"{name}.weight").standard_normal(dim).astype(np.float32) * 0.02
        self.put(f"{name}.weight", value if offset else 1.0 + value)
        if bias:
            self.normal(f"{name}.bias", (dim,), 0.02)


@dataclass(frozen=True)
class Directions:
    pad: np.ndarray
    eos: np.ndarray
    quiet: np.ndarray

    @classmethod
    def draw(cls, tensors: Tensors, dim: int) -> "Directions":
        basis = tensors.rng("tuning.directions").standard_normal((dim, 3))
        q, _ = np.linalg.qr(basis)
        return cls(*(q[:, i].astype(np.float32) for i in range(3)))

    def project_out(self, rows: np.ndarray) -> np.ndarray:
        for d in (self.pad, self.eos, self.quiet):
            rows = rows - np.outer(rows @ d, d)
        return rows
