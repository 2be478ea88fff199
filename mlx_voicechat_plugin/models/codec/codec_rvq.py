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


class ProbabilisticRVQ(nn.Module):
    """Residual VQ over ``num_quantizers`` codebooks of means (nearest mean wins)."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        shape = (config.codebook_size, config.latent_dim)
        self.mus_list = [mx.zeros(shape) for _ in range(config.num_quantizers)]
        # Each codebook's scalar variance (training-time only; kept for strict loading).
        self.variance_list = [{"variance": mx.array(1.0)} for _ in range(config.num_quantizers)]

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
        table, offsets, views = getattr(self, "_stacked", (None, None, []))
        if len(views) == len(self.mus_list) and all(a is b for a, b in zip(views, self.mus_list)):
            # One gather from the stacked codebooks (:meth:`stack`).
            rows = table[codes + offsets[: codes.shape[1], None]]
            picked = [rows[:, q] for q in range(codes.shape[1])]
        else:  # one gather per codebook
            picked = [self.mus_list[q][codes[:, q]] for q in range(codes.shape[1])]
        for row in picked:  # summed in codebook order
            latents = latents + row
        return latents

    def zero_start(self, batch: int, length: int) -> mx.array:
        """Zeros ``[batch, length, D]`` that the latent sum starts from, one array per
        shape: an input of the compiled frame, filled (lazily) by the first frame that
        reads it, instead of a fill inside every frame."""
        shape, dtype = (batch, length, self.mus_list[0].shape[-1]), self.mus_list[0].dtype
        starts = self.__dict__.setdefault("_zero_starts", {})
        if (shape, dtype) not in starts:
            starts[(shape, dtype)] = mx.zeros(shape, dtype=dtype)
        return starts[(shape, dtype)]

    def stack(self) -> None:
        """Hold the codebooks as one ``[Q * C, D]`` table (each codebook a view of it), so
        :meth:`decode` gathers every codebook's rows at once: one kernel, not ``Q``. The
        same rows, added in the same order. A codebook replaced later falls back."""
        size, count = self.mus_list[0].shape[0], len(self.mus_list)
        table = mx.concatenate(self.mus_list)
        offsets = mx.array([q * size for q in range(count)], dtype=mx.int32)
        self.mus_list = [table[q * size : (q + 1) * size] for q in range(count)]
        mx.eval(table, self.mus_list)
        # Outside the module tree (not a parameter): the table, its offsets, the views.
        object.__setattr__(self, "_stacked", (table, offsets, list(self.mus_list)))
