"""One decode position of a Nemotron-H Mamba2 block, with the chunked scan's dead work removed.

Upstream's Mamba2 mixer runs every length through ``mlx_vlm.models.ssm.ssm_update``,
which, off Metal (on the CPU and on CUDA), is the chunked scan ``ssm_attn``: a
segment-sum (repeat, two ``tril`` selects built from ``arange``\\ s, a ``cumsum``),
two ``exp``\\ s, a ``cumsum`` over one position and six matmuls, two of them
outer products with a contraction of length one. At one position with a state
most of it is constant:

* ``segsum`` of a length-1 sequence is ``cumsum(tril(x, -1)) = 0``, so the
  decay ``exp(segsum) = exp(0)`` is exactly 1, and ``tril(CB * 1, 0)`` is
  ``CB`` itself (cast to float32, which is exact);
* ``cumsum(dt * A)`` over one position is ``dt * A``;
* a matmul whose contraction has length one is one rounded product per
  element, which an elementwise multiply gives bit for bit.

So :class:`MambaStep` computes, from the block's own modules and parameters,
``y = CB * (dt x) + exp(dt A) (state . C)`` and
``state' = (dt x) B + exp(dt A) state``, keeping as matmuls of upstream's very
shapes the two products that really reduce (``C . B`` over the state size and
``state . C``), so their summation order is upstream's; every other op is
upstream's op on the same values, in the same order, with the same dtype
promotions. The result is bit-identical to ``block(x, mask=None, cache=...)``
on MLX's CPU backend (``tests/test_mamba_step.py`` checks outputs and both
cache arrays). Two constants upstream recomputes every step, ``-exp(A_log)``
and ``dt_bias`` cast to float32, are computed once. The elementwise work
compiles to four kernels (``dt`` and its decay, per head; the next state and
the output, one fused chain each, the output's ending in the gated norm's
gate multiply), where upstream's scan launches about a dozen more per layer.

On Metal, upstream's ``ssm_update`` is one dedicated kernel at one position;
:func:`use_upstream` says so and the caller keeps the upstream block there.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.activations import swiglu
from mlx_vlm.models.ssm import compute_dt


def use_upstream() -> bool:
    """True where upstream's one-position SSM is a dedicated kernel (Metal GPU)."""
    return mx.metal.is_available() and mx.default_device() == mx.gpu


@mx.compile
def _negative_a(a_log: mx.array) -> mx.array:
    # ssm_attn's ``A``; dt is float32 after compute_dt, so the cast is to float32.
    # Compiled, as upstream's compiled step computes it (one fused kernel).
    return -mx.exp(a_log).astype(mx.float32)


class MambaStep:
    """One position of a ``NemotronHBlock`` of type ``M`` over ``B`` rows with states.

    ``step(x, conv_state, ssm_state) -> (x', conv_state', ssm_state')`` with
    ``x`` of shape ``(B, 1, hidden)``; pure, so it traces into ``mx.compile``.
    """

    def __init__(self, block: Any):
        self.block = block
        self.mixer = block.mixer
        # Constants upstream recomputes every step: -exp(A_log), and dt_bias in
        # float32 (compute_dt adds it to a float32 dt, casting it each time).
        mixer = self.mixer
        heads = (mixer.n_groups, mixer.num_heads // mixer.n_groups, 1, 1)
        # Per head in _ssm's (g, rep, 1, 1) layout, made once: views of the
        # constants would otherwise be nodes of every compiled step.
        self._a_heads = _negative_a(mixer.A_log).reshape(heads)
        self._dt_bias_heads = mixer.dt_bias.astype(mx.float32).reshape(heads)
        self._d_heads = mixer.D.reshape(heads)
        # Scheduled, not waited for: the first frame builds this object, and a
        # frame's host syncs are counted (tests/test_host_syncs.py). Scheduling
        # detaches their graphs, so mx.compile captures them as constants.
        mx.async_eval(self._a_heads, self._dt_bias_heads, self._d_heads)

    def __call__(self, x: mx.array, conv_state: mx.array, ssm_state: mx.array):
        """``x``: ``(B, 1, hidden)``, or one position's ``(B, hidden)`` rows (the products
        then take their input as it is, without a flatten and an unflatten each)."""
        block, mixer = self.block, self.mixer
        projected = mixer.in_proj(block.norm(x))
        # Upstream's split, from the back: checkpoints may pad the projection in front with
        # two unused branches (upstream's mixer, which runs every state's first position,
        # checks their width).
        dt_start = projected.shape[-1] - mixer.num_heads
        conv_start = dt_start - mixer.conv_dim
        gate = projected[..., conv_start - mixer.intermediate_size : conv_start]
        conv_input, dt = projected[..., conv_start:dt_start], projected[..., dt_start:]
        if x.ndim == 2:
            conv_input = conv_input[:, None]

        # Upstream's _conv with a cache and no mask.
        padded = mx.concatenate([conv_state, conv_input], axis=1)
        conv_state = padded[:, -(mixer.conv_kernel_size - 1):, :]
        conv_output = nn.silu(mixer.conv1d(padded))
        inner, groups, size = mixer.intermediate_size, mixer.n_groups, mixer.ssm_state_size
        hidden, B, C = mx.split(conv_output, [inner, inner + groups * size], axis=-1)

        y, ssm_state = self._ssm(hidden, B, C, dt, gate, ssm_state)
        # The rest of MambaRMSNormGated (its gate multiply ran in _ssm's output chain).
        # _ssm's (b, g, rep, 1, dh) is upstream's (b, 1, h * dh) in order: its norm groups
        # are one reshape of it.
        norm = mixer.norm
        y = y.reshape(*x.shape[:-1], -1, norm.group_size)
        y = norm.weight * mx.fast.rms_norm(y, weight=None, eps=norm.eps).flatten(-2)
        return x + mixer.out_proj(y), conv_state, ssm_state

    def _ssm(self, hidden: mx.array, B: mx.array, C: mx.array, dt: mx.array, gate: mx.array,
             state: mx.array) -> tuple[mx.array, mx.array]:
        """``ssm_attn`` at one position with a state (see the module docstring): the output
        ``(b, g, rep, 1, dh)`` and the next state ``(b, h, dh, d)``.

        ``dt`` and its decay ``exp(dt A)`` are per head (one small kernel each);
        the next state and the output are each one elementwise chain built
        from views of its inputs only (a reshape between two elementwise ops
        would end a fused kernel), in the layouts ``(b, g, rep, dh, d)`` and
        ``(b, g, rep, 1, dh)``, whose heads are upstream's ``h = g * rep``.
        """
        mixer = self.mixer
        b = hidden.shape[0]
        h, dh = mixer.num_heads, mixer.head_dim
        g, d = mixer.n_groups, mixer.ssm_state_size
        rep = h // g

        dt = compute_dt(dt.reshape(b, g, rep, 1, 1), self._dt_bias_heads, mixer.time_step_limit)
        # exp(cumsum(dt A)) over one position.
        decay = mx.exp(dt * self._a_heads)

        # The next state: dtx (outer) B, a length-1 contraction (one product per
        # element), plus exp(dt A) state.
        next_state = (dt * hidden.reshape(b, g, rep, dh, 1) * B.reshape(b, g, 1, 1, d)
                      + decay * state.reshape(b, g, rep, dh, d))

        # C^T B per group, upstream's matmul (b, g, 1, d) @ (b, g, d, 1), and
        # state . C, upstream's matmul (b, 1, g, rep, dh, d) @ (b, 1, g, 1, d, 1):
        # the two real reductions, in upstream's shapes and so its summation order.
        B, C = B.reshape(b, 1, g, d), C.reshape(b, 1, g, d)
        cb = mx.swapaxes(C, 1, 2) @ mx.transpose(B, (0, 2, 3, 1))
        y_prev = state.reshape(b, 1, g, rep, dh, d) @ C.reshape(b, 1, g, 1, d, 1)

        # The output: tril(CB * 1) @ dtx, a length-1 contraction (one product,
        # CB in float32), plus exp(dt A) (state . C), cast, plus x D.
        x = hidden.reshape(b, g, rep, 1, dh)
        y = cb.reshape(b, g, 1, 1, 1).astype(mx.float32) * (dt * x)
        y = y + decay * y_prev.reshape(b, g, rep, 1, dh)
        y = y.astype(x.dtype) + x * self._d_heads.astype(x.dtype)
        y = swiglu(gate.reshape(b, g, rep, 1, dh), y)
        return y, next_state.reshape(b, h, dh, d)
