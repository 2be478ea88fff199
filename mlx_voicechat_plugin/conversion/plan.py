"""What a conversion writes, tensor by tensor, before any tensor is read.

Each source tensor (or a quantized source layer's three) becomes one
:class:`Step`: copied; quantized (``.weight`` -> ``.weight`` / ``.scales`` /
``.biases``); dequantized (a quantized source layer under a ``bf16`` format);
or cast to bf16 (a float32 layer under ``bf16``). A layer the source already
stores quantized is kept as it is under any other format: requantizing would
only add error. The plan gives every output tensor's dtype and shape, so the
shards' headers are written first and the bytes per part are known exactly
(``--dry-run``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import mlx.core as mx
from mlx.utils import tree_flatten

from ..config import ModelConfig
from ..profiles import (
    BF16,
    PARTS,
    QUANTIZATION_MODE,
    Format,
    Profile,
    get_profile,
    part_of,
    plan_layers,
    quantizable_modules,
    quantization_config,
)
from .safetensors_io import PlannedTensor, mlx_dtype
from .source import Source, TensorSpec

COPY, QUANTIZE, DEQUANTIZE, CAST = "copy", "quantize", "dequantize", "cast"
# Output shards are cut at this size (as mlx-lm's); a shard is written as it
# is planned, tensor by tensor, so its size does not bound the memory used.
MAX_SHARD_BYTES = 4 * 2**30
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


@dataclass(frozen=True)
class Step:
    inputs: tuple[str, ...]
    outputs: tuple[PlannedTensor, ...]
    action: str = COPY
    bits: int | None = None
    group_size: int | None = None

    @property
    def part(self) -> str:
        return part_of(self.inputs[0]).name


@dataclass
class Plan:
    profile: Profile
    steps: list[Step]
    layers: dict[str, tuple[int, int]]  # quantized module -> (bits, group size), output
    shards: list[list[Step]] = field(default_factory=list)
    kept: int = 0  # layers the source stored quantized, kept as they were

    @property
    def quantization(self) -> dict[str, Any] | None:
        return quantization_config(self.layers)

    def part_bytes(self) -> dict[str, int]:
        sizes: dict[str, int] = defaultdict(int)
        for step in self.steps:
            sizes[step.part] += sum(t.nbytes for t in step.outputs)
        return {part.name: sizes[part.name] for part in PARTS if part.name in sizes}

    def part_formats(self) -> dict[str, str]:
        """Each part's layers as written: their quantizations (a group size can
        be smaller than the profile's where a layer's width needs it), bf16 where
        dequantized or cast, else "as stored"."""
        labels: dict[str, set[str]] = defaultdict(set)
        for step in self.steps:
            if step.bits is not None:
                labels[step.part].add(f"{step.bits}-bit g{step.group_size}")
            elif step.action in (DEQUANTIZE, CAST):
                labels[step.part].add("bf16")
        plain = {part.name: "bf16" if self.profile.formats.get(part.name, Format()).kind == BF16
                 else "as stored" for part in PARTS}
        return {name: ", ".join(sorted(labels[name])) or plain[name]
                for name in self.part_bytes()}

    @property
    def total_bytes(self) -> int:
        return sum(self.part_bytes().values())



def tensors_from_config(config: dict[str, Any]) -> dict[str, TensorSpec]:
    """Tensor shapes of ``config``'s model, bf16, for sizing a checkpoint without
    its weights (module paths as the model names them; the parts' sums are the
    checkpoint's, up to a few small buffers)."""
    from ..models.model import Model

    model = Model(ModelConfig.from_dict(config))
    return {name: TensorSpec("BF16" if value.dtype in _FLOATS else "F32", tuple(value.shape))
            for name, value in tree_flatten(model.parameters())}


def _source_format(quantization: Mapping[str, Any] | None, module: str) -> tuple[int, int]:
    if not quantization:
        raise ValueError(f"{module} is stored quantized but the source config has no "
                         "quantization")
    entry = quantization.get(module)
    if isinstance(entry, dict):
        return int(entry["bits"]), int(entry["group_size"])
    return int(quantization["bits"]), int(quantization["group_size"])


def make_plan(source: Source, profile: "str | Profile",
              max_shard_bytes: int = MAX_SHARD_BYTES) -> Plan:
    """The steps converting ``source`` to ``profile``, cut into shards."""
    profile = get_profile(profile)
    specs = source.tensors
    modules = quantizable_modules(ModelConfig.from_dict(source.config))
    layer_plans = plan_layers(profile, modules)
    stored_quantized = {m for m in modules if f"{m}.scales" in specs}
    steps: list[Step] = []
    layers: dict[str, tuple[int, int]] = {}
    kept = 0
    for key in sorted(specs):
        module, _, leaf = key.rpartition(".")
        spec = specs[key]
        dtype = mlx_dtype(spec.dtype)
        if module in stored_quantized and leaf in ("scales", "biases"):
            continue  # read with the layer's weight
        if module not in modules or leaf != "weight":
            steps.append(Step((key,), (PlannedTensor(key, dtype, spec.shape),)))
            continue
        fmt = profile.format_of(module)
        if module in stored_quantized:
            bits, group = _source_format(source.quantization, module)
            names = [f"{module}.{n}" for n in ("weight", "scales", "biases")
                     if f"{module}.{n}" in specs]
            if fmt.kind == BF16:
                rows, packed = spec.shape
                shape = (rows, packed * 32 // bits)
                steps.append(Step(tuple(names), (PlannedTensor(key, mx.bfloat16, shape),),
                                  DEQUANTIZE, None, None))
            else:
                steps.append(Step(tuple(names), tuple(
                    PlannedTensor(n, mlx_dtype(specs[n].dtype), specs[n].shape)
                    for n in names), COPY, bits, group))
                layers[module] = (bits, group)
                kept += 1
            continue
        layer = layer_plans[module]
        if layer.quantized:
            bits, group = layer.format.bits, layer.group_size
            rows, cols = spec.shape
            assert bits is not None and group is not None
            steps.append(Step((key,), (
                PlannedTensor(f"{module}.biases", dtype, (rows, cols // group)),
                PlannedTensor(f"{module}.scales", dtype, (rows, cols // group)),
                PlannedTensor(key, mx.uint32, (rows, cols * bits // 32)),
            ), QUANTIZE, bits, group))
            layers[module] = (bits, group)
        elif fmt.kind == BF16 and dtype in _FLOATS and dtype != mx.bfloat16:
            steps.append(Step((key,), (PlannedTensor(key, mx.bfloat16, spec.shape),), CAST))
        else:
            steps.append(Step((key,), (PlannedTensor(key, dtype, spec.shape),)))
    plan = Plan(profile, steps, layers, kept=kept)
    plan.shards = _shards(steps, max_shard_bytes)
    return plan


def _shards(steps: list[Step], max_bytes: int) -> list[list[Step]]:
    shards: list[list[Step]] = [[]]
    size = 0
    for step in steps:
        nbytes = sum(t.nbytes for t in step.outputs)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(step)
        size += nbytes
    return shards


def run_step(step: Step, read: Callable[[str], mx.array]) -> dict[str, mx.array]:
    """The output tensors of ``step``; ``read(name)`` gives a source tensor."""
    if step.action == COPY:
        return {name: read(name) for name in step.inputs}
    if step.action == CAST:
        return {step.outputs[0].name: read(step.inputs[0]).astype(mx.bfloat16)}
    if step.action == QUANTIZE:
        weight = read(step.inputs[0])
        packed, scales, biases = mx.quantize(weight, group_size=step.group_size,
                                             bits=step.bits, mode=QUANTIZATION_MODE)
        module = step.inputs[0].rpartition(".")[0]
        return {f"{module}.biases": biases, f"{module}.scales": scales,
                f"{module}.weight": packed}
    # DEQUANTIZE: weight, scales[, biases] of one layer
    arrays = [read(name) for name in step.inputs]
    rows, cols = step.outputs[0].shape
    bits = arrays[0].shape[1] * 32 // cols
    group = cols // arrays[1].shape[1]
    weight = mx.dequantize(*arrays, group_size=group, bits=bits, mode=QUANTIZATION_MODE)
    return {step.outputs[0].name: weight.astype(mx.bfloat16)}
