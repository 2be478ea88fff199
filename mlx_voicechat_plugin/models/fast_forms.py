"""Where ``mx.fast`` ops expand, and the expanded forms that launch fewer kernels there.

On a GPU each ``mx.fast`` op (``rms_norm``, ``layer_norm``, ``rope``,
``scaled_dot_product_attention``) is one kernel. On MLX's CPU backend the same
call builds its *fallback* graph instead (``mlx/fast.cpp``): RMSNorm is a
square, a sum and a fused tail (3 kernels compiled), LayerNorm 5, RoPE about
11 (two ``arange``, ``exp``, ``cos``, ``sin``, casts, the rotation and a
concatenation), recomputed for every call. The forms in this module compute
exactly the fallback's arithmetic, op for op, so their results are the fast
op's bit for bit on the CPU, but share or fuse what the fallback repeats.
They are used only where :func:`fast_ops_expand` holds; a GPU keeps the one
kernel ``mx.fast`` launches.
"""

from __future__ import annotations

import mlx.core as mx


def fast_ops_expand() -> bool:
    """True where ``mx.fast`` ops run as their fallback graphs (MLX's CPU backend)."""
    return mx.default_device().type == mx.DeviceType.cpu
