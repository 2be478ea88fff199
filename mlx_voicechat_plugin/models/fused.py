"""Projections that read the same input, as one matrix product.

An attention block multiplies its input by three matrices (q, k, v) and a
gated MLP by two (gate, up). At the one or two rows a frame multiplies, each
product is mostly its launch: a GPU frame pays per kernel, whatever the
matrix sizes. :class:`Fused` stacks such matrices along their outputs, so one
product gives every block of outputs; each output is the same sum of the same
products in the same order as in its own product, so the bits are the same
where the device computes a column block independently of the others (MLX's
CPU backend does, float and quantized). That is probed on the running device
with the real matrices (:func:`fuse`, at several row counts) before anything
is fused; where it does not hold the modules stay separate. The verdict
depends on the device's kernels for those shapes and dtypes, not on the
values, so ``Model.prepare`` remembers it per device, MLX version and stack
(:class:`~.remembered.ProbeVerdicts`): a model loaded before is not probed
again (the probe ran 42 s of each full-size load on a CPU).

The modules keep working on their own (the plain paths: prefill, warm-up, a
stream's first frame): their weights become views of the stacked matrix, so
the weights are held once. Fusing happens at ``Model.prepare``, after
``weight_layout``; ``Model.update`` forgets them (new weights are not
stacked until ``prepare`` runs again).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from .remembered import ProbeVerdicts
from .weight_layout import HeldLinear, RowMajorLinear, layouts_agree

logger = logging.getLogger(__name__)

# Row counts a fused product must agree at: one stream, its [cond; uncond] pair,
# and batches of sessions.
PROBE_ROWS = (1, 2, 8, 32)

# The MoG depth head's three products of its features (logits, log-std, the
# latent's shared part), each pass of every frame.
HEADS = ("proj_logits", "proj_logs", "proj_else")

# What a block fuses, tried in order: the fused layer's attribute and the modules'.
FUSIONS = (("fused_qkv", ("q_proj", "k_proj", "v_proj")),  # an attention block
           ("fused_qkv", ("linear_q", "linear_k", "linear_v")),  # a conformer's
           ("fused_gate_up", ("gate_proj", "up_proj")),  # a gated MLP
           ("fused_heads", HEADS))  # the MoG depth head's output heads
FUSED = ("fused_qkv", "fused_gate_up", "fused_heads")


class Fused:
    """Several linear layers over one input as one product (biases stacked too).

    ``fused(x)`` returns the layers' outputs, in order, as views of one product.
    """

    def __init__(self, layer: nn.Module, sizes: Sequence[int]):
        self.layer = layer
        self.sizes = tuple(sizes)
        self.splits = [sum(self.sizes[: i + 1]) for i in range(len(self.sizes) - 1)]
        self.modules: list[Any] = []  # the modules it stands for, once fused

    def serves(self, modules: Sequence[Any]) -> bool:
        """Still these module objects (one replaced since, e.g. quantized, falls back to
        the modules). Not the weights' identity: ``mx.compile(..., inputs=state)`` hands
        a module's arrays back as new objects after a trace. Weights replaced in place
        need :func:`unfuse` (``Model.update`` calls it)."""
        return len(modules) == len(self.modules) and all(
            m is module for m, module in zip(modules, self.modules))

    def __call__(self, x: mx.array) -> list[mx.array]:
        return mx.split(self.layer(x), self.splits, axis=-1)


def _quantized(module: Any) -> bool:
    return type(module) is nn.QuantizedLinear and "bias" not in module


def _bare(kind: type) -> Any:
    """An empty layer of ``kind`` (its own ``__call__``; no random weights drawn)."""
    layer = kind.__new__(kind)
    nn.Module.__init__(layer)
    return layer


def _stack(modules: Sequence[Any]) -> nn.Module | None:
    """The stacked layer (``None``: the modules do not stack)."""
    first = modules[0]
    if all(type(m) in (nn.Linear, HeldLinear, RowMajorLinear) for m in modules):
        dtype, kind, biased = first.weight.dtype, type(first), "bias" in first
        if any(type(m) is not kind or ("bias" in m) != biased or m.weight.dtype != dtype
               or m.weight.shape[1] != first.weight.shape[1] for m in modules):
            return None
        if layouts_agree(dtype):  # weight_layout stored every such matrix transposed
            # The stack transposed ([in, sum out], contiguous) in one copy, shown as
            # [sum out, in]: row_major(concatenate(weights)), without the two
            # transposing copies (each ``m.weight.T`` is already contiguous where
            # weight_layout moved it: a plain copy; the stacks took 2.6 s of a
            # full-size load on a CPU, 1.0 s this way).
            weight = mx.concatenate([m.weight.T for m in modules], axis=1).T
        else:
            weight = mx.concatenate([m.weight for m in modules])
        layer = _bare(kind)
        layer.weight = weight
        if biased:
            layer.bias = mx.concatenate([m.bias for m in modules])
        return layer
    if all(_quantized(m) for m in modules):
        if any((m.bits, m.group_size, m.mode) != (first.bits, first.group_size, first.mode)
               or m.weight.shape[1] != first.weight.shape[1] for m in modules):
            return None
        layer = _bare(nn.QuantizedLinear)
        layer.group_size, layer.bits, layer.mode = first.group_size, first.bits, first.mode
        layer.biases = None
        names = [n for n in ("weight", "scales", "biases") if first.get(n) is not None]
        for name in names:
            setattr(layer, name, mx.concatenate([m[name] for m in modules]))
        layer.freeze()
        return layer
    return None


def _agrees(fused: Fused, modules: Sequence[Any]) -> bool:
    inputs = (modules[0].weight.shape[1] * 32 // modules[0].bits
              if _quantized(modules[0]) else modules[0].weight.shape[1])
    # Inputs in float32 (what a float32-held model feeds any weight) and in the
    # weights' own dtype: a product's kernel depends on both.
    dtypes = {mx.float32} if _quantized(modules[0]) else {mx.float32, modules[0].weight.dtype}
    key = mx.random.key(11)
    for rows, dtype in ((r, d) for r in PROBE_ROWS for d in dtypes):
        key, sub = mx.random.split(key)
        x = mx.random.normal((rows, inputs), key=sub).astype(dtype)
        apart = [m(x) for m in modules]
        together = fused(x)
        mx.eval(apart, together)
        if not all(mx.array_equal(a, b).item() for a, b in zip(apart, together)):
            return False
    return True


def probe_key(modules: Sequence[Any]) -> str:
    """What the probe's verdict on stacking ``modules`` depends on: their kind, dtypes,
    shapes, bias, quantization and the layout the stack is held in."""
    first = modules[0]
    quantization = ((first.bits, first.group_size, first.mode) if _quantized(first) else None)
    return "|".join(str(part) for part in (
        type(first).__name__, first.weight.dtype, "bias" in first, quantization,
        layouts_agree(first.weight.dtype) if not _quantized(first) else None,
        [tuple(m.weight.shape) for m in modules]))


def fuse(modules: Sequence[Any], verdicts: ProbeVerdicts | None = None) -> Fused | None:
    """``modules`` (linear layers of one input, all biased or none) as one :class:`Fused`, or
    ``None`` when they cannot be stacked or the stacked product would change a bit
    on this device. On success each module's weights become views of the stack.
    ``verdicts``: the probe's remembered verdicts (read, and added to)."""
    layer = _stack(modules)
    if layer is None:
        return None
    mx.eval(layer.parameters())
    fused = Fused(layer, [m.weight.shape[0] for m in modules])
    verdicts = verdicts or ProbeVerdicts(None)
    if not verdicts.verdict(probe_key(modules), lambda: _agrees(fused, modules)):
        return None
    for module, start, size in zip(modules, [0, *fused.splits], fused.sizes):
        for name in ("weight", "bias", "scales", "biases"):
            if module.get(name) is not None:
                setattr(module, name, layer[name][start : start + size])
    fused.modules = list(modules)
    return fused


def fuse_projections(blocks: Sequence[Any], verdicts: ProbeVerdicts | None = None) -> int:
    """Fuse each block's q/k/v (an attention block: ``q_proj``, ``k_proj``, ``v_proj``,
    or a conformer's ``linear_q``, ``linear_k``, ``linear_v``), gate/up (a gated
    MLP: ``gate_proj``, ``up_proj``) or output heads (the MoG head's :data:`HEADS`).
    The fused layer is kept on the block as ``fused_qkv`` / ``fused_gate_up`` /
    ``fused_heads`` (a plain attribute, not a parameter), where the step code
    finds it (:func:`project`, :func:`gated_mlp`).
    ``verdicts``: remembered probe verdicts (saved back when new ones were made).
    Returns how many blocks were fused."""
    done = 0
    for block in blocks:
        found = next(((name, [getattr(block, n) for n in names]) for name, names in FUSIONS
                      if all(hasattr(block, n) for n in names)), None)
        if found is None:
            raise TypeError(f"{type(block).__name__} has no projections to fuse")
        name, modules = found
        fused = fuse(modules, verdicts)
        if fused is not None:
            setattr(block, name, fused)
            done += 1
    if verdicts is not None:
        verdicts.save()
    if blocks and not done:
        logger.info("projections kept apart: stacked products differ on this device")
    return done


def fused_layers(blocks: Sequence[Any]) -> list[nn.Module]:
    """The stacked layers ``blocks`` hold (not in the model's module tree)."""
    return [fused.layer for block in blocks
            for fused in (getattr(block, n, None) for n in FUSED) if fused is not None]


def unfuse(blocks: Sequence[Any]) -> None:
    """Forget the fused layers of ``blocks`` (their weights are being replaced)."""
    for block in blocks:
        for name in FUSED:
            setattr(block, name, None)


def project(owner: Any, name: str, modules: Sequence[Any], x: mx.array) -> list[mx.array]:
    """``[m(x) for m in modules]``, as one product when ``owner`` has them fused."""
    fused = getattr(owner, name, None)
    if fused is not None and fused.serves(modules):
        return fused(x)
    return [m(x) for m in modules]


def gated_mlp(mlp: Any, x: mx.array) -> mx.array:
    """``down(gelu_tanh(gate(x)) * up(x))`` (Gemma-3's MLP and EAR-TTS's), gate/up fused
    when they are; the same expression as the modules' own call."""
    gate, up = project(mlp, "fused_gate_up", (mlp.gate_proj, mlp.up_proj), x)
    return mlp.down_proj(nn.gelu_approx(gate) * up)
