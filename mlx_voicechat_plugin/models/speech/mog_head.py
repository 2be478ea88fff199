"""Mixture-of-Gaussians depth head of EAR-TTS, with nucleus (top-p) sampling.

One call samples a mixture component per position (Gumbel-max over top-p
filtered logits) and returns that component's mean in latent space plus the
shared log-std. Random draws: exactly one ``mx.random.uniform`` of the logits'
shape per call (from ``key`` if given, else MLX's global state). Several
independent streams batched as rows pass keys ``[B, 2]``, one per row, instead (see
:func:`draw`): each row then gets exactly the draw it would get alone.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Union

import mlx.core as mx
import mlx.nn as nn

from ...config import MoGConfig
from ..fused import project
from .layers import GatedMLP, OffsetRMSNorm

# Guards of the Gumbel transform ``-log(-log(u))`` against log(0).
_GUMBEL_EPS = 1e-8

# A key ``[2]``, one key per batch row ``[B, 2]`` (independent streams), or
# None (MLX's global random state).
Keys = Union[mx.array, None]


def draw(sampler: Callable[..., mx.array], shape: tuple[int, ...], key: Keys) -> mx.array:
    """``sampler(shape=shape, key=key)``, or with keys ``[shape[0], 2]``: one draw
    of ``(1, *shape[1:])`` per row from that row's key (one vmapped draw).

    Row ``b`` of a per-row draw is bit-identical to drawing ``(1, *shape[1:])``
    alone with ``key[b]``: the same key, shape and dtype give the same bits.
    """
    if key is None or key.ndim == 1:
        return sampler(shape=shape, key=key)
    if key.shape[0] != shape[0]:
        raise ValueError(f"per-row keys: got {key.shape[0]} keys for {shape[0]} rows")
    if key.shape[0] == 1:
        # One row: the plain draw from its key, the same bits as the vmapped
        # draw; measured ~0.1-0.3 ms a frame cheaper in the compiled depth loop
        # of one session (CPU, tiny and small fixtures).
        return sampler(shape=shape, key=key[0])
    row = (1, *shape[1:])
    return mx.vmap(lambda k: sampler(shape=row, key=k))(key).reshape(shape)


class KeyStream(Protocol):
    """A source of PRNG keys, one per draw (e.g. ``runtime.rng.RandomStream``).

    A stream may also offer ``take(n)``: the next ``n`` keys stacked, in one call.
    """

    def next(self) -> mx.array: ...


class KeyRows:
    """Keys drawn in advance, ``[B, count, 2]``, handed out in order inside the
    compiled depth loop: each ``next`` is the next key of every session, ``[B, 2]``
    (one key per row; :func:`~.mog_head.draw` draws each row from its own), or of
    the one session, ``[2]``."""

    def __init__(self, keys: mx.array):
        self.keys = keys
        self.index = 0

    def next(self) -> mx.array:
        # One session: its key itself, ``[2]`` (what ``draw`` takes from a one-row
        # ``[1, 2]``, without a second slice of it).
        keys = self.keys[0, self.index] if self.keys.shape[0] == 1 else self.keys[:, self.index]
        self.index += 1
        return keys


def take_keys(rng: KeyStream, count: int) -> mx.array:
    """The stream's next ``count`` keys, stacked ``[count, 2]`` (``take``, or ``next`` each)."""
    take = getattr(rng, "take", None)
    return take(count) if take is not None else mx.stack([rng.next() for _ in range(count)])


def next_key(rng: Any) -> Keys:
    """The stream's next key, or ``None`` (MLX's global random state) without one."""
    return None if rng is None else rng.next()


def top_p_mask(logits: mx.array, top_p: float | mx.array) -> mx.array:
    """Set logits outside the nucleus of mass ``top_p`` to ``-inf``.

    A component survives while the probability mass of the components ranked
    above it is below ``top_p`` (so the most likely one always survives).
    ``top_p`` may be one value per row (``[rows, 1]`` float32): a row at 1 keeps
    every component, and each row's mask equals the scalar one's.
    """
    if isinstance(top_p, mx.array):
        return _nucleus(logits, top_p, every=top_p >= 1.0)
    if top_p >= 1.0:
        return logits
    if top_p <= 0.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return _nucleus(logits, top_p)


def _nucleus(logits: mx.array, top_p: float | mx.array, every: mx.array | None = None) -> mx.array:
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    order = mx.stop_gradient(mx.argsort(probs, axis=-1))  # ascending
    ranked = mx.take_along_axis(probs, order, axis=-1)
    # Mass strictly above each ranked entry: a reverse, exclusive running sum.
    above = mx.cumsum(ranked, axis=-1, reverse=True, inclusive=False)
    keep = mx.put_along_axis(
        mx.zeros(ranked.shape, dtype=mx.bool_), order, above < top_p, axis=-1
    )
    if every is not None:
        keep = keep | every
    return mx.where(keep, logits, -float("inf"))


def gumbel_argmax(logits: mx.array, key: Keys, draw_shape: tuple[int, ...]) -> mx.array:
    """Sample one index per row of ``logits``; draws one uniform of their size.

    ``draw_shape`` (same size as ``logits``) is the shape the uniform is drawn in;
    ``key`` may be one key per leading row of it (:func:`draw`).
    """
    u = draw(mx.random.uniform, draw_shape, key).reshape(logits.shape)
    gumbel = -mx.log(-mx.log(u + _GUMBEL_EPS) + _GUMBEL_EPS)
    log_probs = mx.log(mx.softmax(logits.astype(mx.float32), axis=-1))
    return mx.argmax(log_probs + gumbel, axis=-1)


class ResidualMLP(nn.Module):
    """Pre/post-normed gated MLP with a residual connection."""

    def __init__(self, dims: int, hidden_dims: int, eps: float):
        super().__init__()
        self.pre_norm = OffsetRMSNorm(dims, eps)
        self.mlp = GatedMLP(dims, hidden_dims)
        self.post_norm = OffsetRMSNorm(dims, eps)

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.post_norm(self.mlp(self.pre_norm(x)))


class MoGHead(nn.Module):
    """Hidden state -> sampled latent mean ``mu`` and log-std ``logs``.

    Component ``k`` has mean ``exp(logs) * low_mat[k] @ (W_k @ x) + proj_else(x)``
    where ``W_k`` is the ``k``-th ``[low_rank, dims]`` block of ``proj_mus``.
    """

    def __init__(self, dims: int, latent_size: int, config: MoGConfig):
        super().__init__()
        self.latent_size = latent_size
        self.low_rank = config.low_rank
        self.num_predictions = config.num_predictions
        self.min_log_std = config.min_log_std
        # Residual MLPs then a final norm; checkpoint keys index them as one list.
        self.mlp_stack = [
            ResidualMLP(dims, config.intermediate_size, config.eps)
            for _ in range(config.num_layers)
        ] + [OffsetRMSNorm(dims, config.eps)]
        self.proj_logits = nn.Linear(dims, config.num_predictions, bias=False)
        self.proj_mus = nn.Linear(dims, config.num_predictions * config.low_rank, bias=False)
        self.proj_logs = nn.Linear(dims, 1, bias=False)
        self.proj_else = nn.Linear(dims, latent_size, bias=False)
        self.low_mat = mx.zeros((config.num_predictions, latent_size, config.low_rank))

    def heads(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        """The three products of the features (:data:`~.fused.HEADS`), fused at load."""
        return self.proj_logits, self.proj_logs, self.proj_else

    def sampled_blocks(self, component: mx.array, dims: int) -> mx.array:
        """The ``[low_rank, dims]`` blocks of ``proj_mus`` of each sampled component.

        A quantized ``proj_mus`` is gathered packed and only the gathered blocks
        are dequantized, in float32: the affine values ``scale * q + bias``
        exactly, as the quantized matmul kernels use them (a bf16 dequantization
        would round them).
        """
        proj = self.proj_mus
        blocks = (self.num_predictions, self.low_rank)
        if not isinstance(proj, nn.QuantizedLinear):
            return proj.weight.reshape(*blocks, dims)[component]
        packed = proj.weight.reshape(*blocks, -1)[component]
        affine = [proj[n].reshape(*blocks, -1)[component].astype(mx.float32)
                  for n in ("scales", "biases") if proj.get(n) is not None]
        return mx.dequantize(packed, *affine, group_size=proj.group_size, bits=proj.bits,
                             mode=proj.mode)

    def features(self, x: mx.array) -> mx.array:
        for layer in self.mlp_stack:
            x = layer(x)
        return x

    def __call__(
        self,
        x: mx.array,
        guidance_scale: float = 0.0,
        top_p: float | mx.array = 1.0,
        key: Keys = None,
    ) -> tuple[mx.array, mx.array]:
        """``x`` [B, T, dims] (``[cond; uncond]`` when guided) -> (mu, logs).

        ``top_p``: one nucleus for every row, or one per output row (``[B]`` float32).
        ``key`` seeds the Gumbel draw; ``None`` uses MLX's global random state;
        keys ``[B, 2]``, one per output row (per cond row when guided), draw
        each row from its own key.
        """
        batch, length, dims = x.shape
        # Rows [B * T, dims] throughout: the same arithmetic without a
        # reshape around every projection.
        x = self.features(x.reshape(-1, dims))
        if guidance_scale > 0.0:  # classifier-free guidance over [cond; uncond]: c + s (c - u)
            if x.shape[0] % 2:
                raise ValueError("classifier-free guidance needs a [cond; uncond] batch")
            cond, uncond = x[: x.shape[0] // 2], x[x.shape[0] // 2 :]
            x = cond + guidance_scale * (cond - uncond)
            batch //= 2
        logits, logs, shared = project(self, "fused_heads", self.heads(), x)
        if isinstance(top_p, mx.array):  # per output row, over its positions
            top_p = mx.repeat(top_p, length)[:, None]
        logits = top_p_mask(logits, top_p)
        component = gumbel_argmax(
            logits, key, draw_shape=(batch, length, self.num_predictions)
        )

        # Only the sampled component's low-rank projection is evaluated.
        low = self.sampled_blocks(component, dims) @ x[..., None]
        mu = (self.low_mat[component] @ low).squeeze(-1)
        logs = mx.maximum(logs, self.min_log_std)
        mu = mu * mx.exp(logs) + shared
        return mu.reshape(batch, length, -1), logs.reshape(batch, length, 1)
