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
from typing import Sequence

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
    picked = []
    for k in range(len(codebooks)):
        table = codebooks[k]
        index = mx.argmin(_distances(residual, table, norms[k], one_product), axis=-1)
        residual = residual - table[index]
        picked.append(index)
    return picked


def _distances(residual: mx.array, table: mx.array, norms: mx.array, one_product: bool) -> mx.array:
    if one_product:
        return mx.addmm(norms, residual, table.T, alpha=-2.0, beta=1.0)
    return norms - 2.0 * (residual @ table.T)


def distance_in_one_product(tables: Sequence[mx.array], norms: Sequence[mx.array],
                            dtype: mx.Dtype = mx.float32,
                            rows: Sequence[int] = (1, 2, 8, 32)) -> bool:
    """Whether this device's ``addmm`` gives the RVQ distances' bits for ``dtype``
    residuals (the scaling by -2 is exact, so it does where it sums the product as
    ``matmul`` does and rounds once), probed with the real first table at several
    row counts."""
    key = mx.random.key(13)
    for count in rows:
        key, sub = mx.random.split(key)
        residual = mx.random.normal((count, tables[0].shape[1]), key=sub).astype(dtype)
        a = _distances(residual, tables[0], norms[0], False)
        b = _distances(residual, tables[0], norms[0], True)
        if not mx.array_equal(a, b).item():
            return False
    return True


class CodebookTables:
    """Per-codebook ``[C, D]`` tables and their norms, evaluated once per weight array."""

    def __init__(self, rvq_embs: mx.array):
        self.source = rvq_embs
        norms = codebook_norms(rvq_embs)
        self.tables = [rvq_embs[k] for k in range(rvq_embs.shape[0])]
        self.norms = [norms[k] for k in range(rvq_embs.shape[0])]
        # The depth loop's residuals are float32 (its noise is): a product or
        # difference with a lower-precision table promotes the table to float32
        # (exactly), every codebook of every frame. Promoted once here instead.
        wide = rvq_embs.dtype == mx.float32
        self.tables32 = self.tables if wide else [t.astype(mx.float32) for t in self.tables]
        self.norms32 = self.norms if wide else [n.astype(mx.float32) for n in self.norms]
        mx.eval(self.tables, self.norms, self.tables32, self.norms32)
        # Whether float32 distances may be one addmm (rvq_assign's one_product).
        self.one_product = distance_in_one_product(self.tables32, self.norms32)

    def arrays(self) -> tuple[list[mx.array], ...]:
        """What the compiled depth loop takes: both sets of tables and norms."""
        return self.tables, self.norms, self.tables32, self.norms32

    @staticmethod
    def pick(arrays: tuple[list[mx.array], ...], dtype: mx.Dtype) -> tuple[list, list]:
        """The tables and norms for residuals of ``dtype`` (from :meth:`arrays`)."""
        tables, norms, tables32, norms32 = arrays
        return (tables32, norms32) if dtype == mx.float32 else (tables, norms)
