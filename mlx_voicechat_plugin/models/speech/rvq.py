"""Residual vector quantization of the depth loop: the unmasking schedule, the nearest-code
assignment and the codebook tables it reads.

A depth pass of EAR-TTS decides a block of codebooks: its latent is assigned,
codebook by codebook, to the nearest code of each (greedy residual
quantization, :func:`rvq_assign`); :func:`unmasking_schedule` says how many
codebooks each pass decides. :class:`CodebookTables` holds the per-codebook
tables and norms, made once per weight array.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import mlx.core as mx


def unmasking_schedule(
    num_quantizers: int, num_iterations: int, exponent: float
) -> tuple[int, ...]:
    """Codebooks decided at each depth pass (sums to ``num_quantizers``).

    Pass ``i`` leaves ``ceil((1 - (i/n)**e)**(1/e) * Q)`` codebooks still masked
    before it runs; a pass decides the difference to the next one.
    """
    masked = [
        math.ceil(((1.0 - (i / num_iterations) ** exponent) ** (1.0 / exponent)) * num_quantizers)
        for i in range(num_iterations)
    ]
    return tuple(now - later for now, later in zip(masked, masked[1:] + [0]))


def codebook_norms(codebooks: mx.array) -> mx.array:
    """Squared norm of every code: ``[K, C, D]`` -> ``[K, C]``."""
    return (codebooks * codebooks).sum(axis=-1)


def rvq_assign(
    residual: mx.array,
    codebooks: mx.array | list[mx.array],
    norms: mx.array | list[mx.array] | None = None,
    one_product: bool = False,
) -> list[mx.array]:
    """Greedy residual quantization of ``residual`` [..., D] by ``codebooks`` [K, C, D].

    ``codebooks`` may also be a list of ``[C, D]`` tables, with ``norms`` their
    :func:`codebook_norms` rows (computed here when not given). Returns one
    index array [...] per codebook, in order. The distance to every code is
    ``norms - 2 r.c``; ``one_product`` computes it as one ``addmm`` (alpha -2,
    beta 1) instead of a product then an elementwise step, where
    :func:`distance_in_one_product` found the same bits.
    """
    if norms is None:
        norms = codebook_norms(codebooks if isinstance(codebooks, mx.array) else mx.stack(codebooks))
    return [index for _, index in _assign(residual, codebooks, norms, one_product, None)]


def rvq_block(residual: mx.array, tables: Sequence[mx.array], norms: Sequence[mx.array],
              transposed: Sequence[mx.array], one_product: bool = False) -> mx.array:
    """:func:`rvq_assign`'s indices as one ``[..., K]`` block (``uint32``), from
    :class:`CodebookTables`' lists: ``transposed`` holds each table's evaluated
    ``[D, C]`` view (the product's operand, not a transpose of every frame), and each
    index keeps its axis so the block is one concatenation (no expansion per index)."""
    picked = _assign(residual, tables, norms, one_product, transposed)
    return mx.concatenate([kept for kept, _ in picked], axis=-1)


def _assign(residual: mx.array, codebooks: mx.array | Sequence[mx.array],
            norms: mx.array | Sequence[mx.array], one_product: bool,
            transposed: Sequence[mx.array] | None) -> list[tuple[mx.array, mx.array]]:
    """Greedy assignment: each codebook's index with its axis kept, ``[..., 1]``, and
    without it (``argmin``'s own two steps, the same ops as ever)."""
    picked = []
    for k in range(len(codebooks)):
        table = codebooks[k]
        matrix = table.T if transposed is None else transposed[k]
        kept = mx.argmin(_distances(residual, matrix, norms[k], one_product), axis=-1,
                         keepdims=True)
        index = kept.squeeze(-1)
        residual = residual - table[index]
        picked.append((kept, index))
    return picked


def _distances(residual: mx.array, matrix: mx.array, norms: mx.array, one_product: bool) -> mx.array:
    """Distances to every code; ``matrix`` is the table transposed, ``[D, C]``."""
    if one_product:
        return mx.addmm(norms, residual, matrix, alpha=-2.0, beta=1.0)
    return norms - 2.0 * (residual @ matrix)


def distance_in_one_product(tables: Sequence[mx.array], norms: Sequence[mx.array]) -> bool:
    """Whether this device's ``addmm`` gives the RVQ distances' bits for float32
    residuals (the scaling by -2 is exact, so it does where it sums the product as
    ``matmul`` does and rounds once), probed with the real first table at several
    row counts."""
    key = mx.random.key(13)
    for count in (1, 2, 8, 32):
        key, sub = mx.random.split(key)
        residual = mx.random.normal((count, tables[0].shape[1]), key=sub)  # float32
        a = _distances(residual, tables[0].T, norms[0], False)
        b = _distances(residual, tables[0].T, norms[0], True)
        if not mx.array_equal(a, b).item():
            return False
    return True


class CodebookTables:
    """Per-codebook ``[C, D]`` tables and their norms, evaluated once per weight array."""

    def __init__(self, rvq_embs: mx.array, hold_f32: bool = True):
        """``hold_f32`` ``False``: no float32 copies of lower-precision tables (the
        memory plan's choice, ``budget``): float32 residuals then promote the stored
        tables in each product, exactly, as they would without the copies."""
        norms = codebook_norms(rvq_embs)
        self.tables = [rvq_embs[k] for k in range(rvq_embs.shape[0])]
        self.norms = [norms[k] for k in range(rvq_embs.shape[0])]
        # The depth loop's residuals are float32 (its noise is): a product or
        # difference with a lower-precision table promotes the table to float32
        # (exactly), every codebook of every frame. Promoted once here instead.
        wide = rvq_embs.dtype == mx.float32 or not hold_f32
        self.tables32 = self.tables if wide else [t.astype(mx.float32) for t in self.tables]
        self.norms32 = self.norms if wide else [n.astype(mx.float32) for n in self.norms]
        # Each table's [D, C] operand held as an evaluated view (the same strides as
        # the transpose the product would otherwise take every frame), and the
        # codebooks as one [Q * C, D] table for the code embedding's gather.
        self.transposed = [t.T for t in self.tables]
        self.transposed32 = [t.T for t in self.tables32]
        self.flat = rvq_embs.reshape(-1, rvq_embs.shape[-1])
        mx.eval(self.tables, self.norms, self.tables32, self.norms32, self.transposed,
                self.transposed32, self.flat)
        # Whether float32 distances may be one addmm (rvq_assign's one_product).
        self.one_product = distance_in_one_product(self.tables32, self.norms32)

    def arrays(self) -> tuple[Any, ...]:
        """What the compiled depth loop takes: both sets of tables, norms and transposed
        tables, and the flat table."""
        return (self.tables, self.norms, self.transposed, self.tables32, self.norms32,
                self.transposed32, self.flat)

    @staticmethod
    def pick(arrays: tuple[Any, ...], dtype: mx.Dtype) -> tuple[list, list, list]:
        """The tables, norms and transposed tables for residuals of ``dtype`` (from
        :meth:`arrays`)."""
        return arrays[3:6] if dtype == mx.float32 else arrays[:3]
