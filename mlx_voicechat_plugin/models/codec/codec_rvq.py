"""The codec's probabilistic RVQ: latents to codes by nearest mean, codes to latents by sum.

:class:`ProbabilisticRVQ` holds ``num_quantizers`` codebooks of means; a
frame's latent is the sum of its codes' means, in codebook order. Held as one
stacked table (:meth:`ProbabilisticRVQ.stack`), a frame gathers every
codebook's rows in one kernel.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...config import CodecConfig


class Variance(nn.Module):
    """One codebook's scalar variance (training-time only; kept for strict loading)."""

    def __init__(self):
        super().__init__()
        self.variance = mx.array(1.0)


class ProbabilisticRVQ(nn.Module):
    """Residual VQ over ``num_quantizers`` codebooks of means (nearest mean wins)."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        shape = (config.codebook_size, config.latent_dim)
        self.mus_list = [mx.zeros(shape) for _ in range(config.num_quantizers)]
        self.variance_list = [Variance() for _ in range(config.num_quantizers)]

    def encode(self, latents: mx.array) -> mx.array:
        """``[B, T, D]`` latents -> ``[B, Q, T]`` int32 codes."""
        residual = latents
        codes = []
        for means in self.mus_list:
            # Squared distances in the expanded form the reference uses, so that
            # near-ties round (and resolve) the same way.
            distances = (
                mx.sum(residual * residual, axis=-1, keepdims=True)
                - 2.0 * (residual @ means.T)
                + mx.sum(means * means, axis=-1)
            )
            index = mx.argmin(distances, axis=-1)
            codes.append(index)
            residual = residual - means[index]
        return mx.stack(codes, axis=1).astype(mx.int32)

    def decode(self, codes: mx.array, start: mx.array | None = None) -> mx.array:
        """``[B, Q, T]`` codes (``Q <= num_quantizers``) -> ``[B, T, D]`` latents.

        ``start``: the sum's zero start (:meth:`zero_start`) when the caller holds it."""
        if codes.ndim != 3:
            raise ValueError(f"codes must be [B, Q, T], got shape {codes.shape}")
        if codes.shape[1] > len(self.mus_list):
            raise ValueError(
                f"got {codes.shape[1]} codebooks, the codec has {len(self.mus_list)}"
            )
        latents = start if start is not None else self.zero_start(codes.shape[0], codes.shape[2])
        stacked = getattr(self, "_stacked", None)
        if stacked is not None and stacked.serves(self.mus_list):
            # One gather from the stacked codebooks (:meth:`stack`), summed in codebook order.
            rows = stacked.table[codes + stacked.offsets[: codes.shape[1], None]]
            for q in range(codes.shape[1]):
                latents = latents + rows[:, q]
            return latents
        # One gather per codebook, summed in codebook order.
        for q in range(codes.shape[1]):
            latents = latents + self.mus_list[q][codes[:, q]]
        return latents

    def zero_start(self, batch: int, length: int) -> mx.array:
        """Zeros ``[batch, length, D]`` that the latent sum starts from, one array per
        shape: an input of the compiled frame, filled (lazily) by the first frame that
        reads it, instead of a fill inside every frame."""
        shape, dtype = (batch, length, self.mus_list[0].shape[-1]), self.mus_list[0].dtype
        starts = self.__dict__.setdefault("_zero_starts", {})
        zeros = starts.get((shape, dtype))
        if zeros is None:
            zeros = starts[(shape, dtype)] = mx.zeros(shape, dtype=dtype)
        return zeros

    def stack(self) -> None:
        """Hold the codebooks as one ``[Q * C, D]`` table (each codebook a view of it), so
        :meth:`decode` gathers every codebook's rows at once: one kernel, not ``Q``. The
        same rows, added in the same order. A codebook replaced later falls back."""
        object.__setattr__(self, "_stacked", _StackedCodebooks(self.mus_list))
        self.mus_list = list(self._stacked.views)


class _StackedCodebooks:
    """The codebooks of a :class:`ProbabilisticRVQ` in one table, and each one's row offset."""

    def __init__(self, codebooks: list[mx.array]):
        size = codebooks[0].shape[0]
        self.table = mx.concatenate(codebooks)
        self.offsets = mx.array([q * size for q in range(len(codebooks))], dtype=mx.int32)
        self.views = [self.table[q * size : (q + 1) * size] for q in range(len(codebooks))]
        mx.eval(self.table, self.views)

    def serves(self, codebooks: list[mx.array]) -> bool:
        return len(codebooks) == len(self.views) and all(
            a is b for a, b in zip(codebooks, self.views))
