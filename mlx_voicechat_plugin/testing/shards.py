"""Writing fixture weights tensor by tensor: quantize, evaluate, and shard as they come.

The ``full`` fixture is about 21 GB of bfloat16 before quantizing; holding
every lazily drawn tensor until the end does not fit a 24 GB machine. A
:class:`ShardWriter` takes each tensor as it is drawn, quantizes it (where a
quantized checkpoint would), evaluates it, and writes a shard whenever the
pending tensors reach ``max_shard_bytes``: the peak is one shard plus one
tensor's graph, whatever the size. Shards are named as mlx-lm names them
(``model.safetensors`` when there is one, ``model-00001-of-00003.safetensors``
otherwise) with the usual index; each shard's tensors are sorted by name, so
a checkpoint that fits one shard is byte-identical to writing the whole
sorted dict at once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import mlx.core as mx

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
QUANTIZATION_GROUP_SIZE = 64
SUPPORTED_BITS = (4, 8)
# Bytes of evaluated tensors held before a shard is written.
MAX_SHARD_BYTES = 2 * 2**30

# Modules of the language model that mlx-community conversions quantize.
_QUANTIZED_SUFFIXES = (
    ".in_proj",
    ".out_proj",
    ".q_proj",
    ".k_proj",
    ".v_proj",
    ".o_proj",
    ".up_proj",
    ".down_proj",
)
_QUANTIZED_HEADS = (
    "stt_model.embed_tokens",
    "stt_model.lm_head",
    "stt_model.function_head",
)


def is_quantized_module(path: str) -> bool:
    """Whether a quantized fixture stores module ``path`` quantized."""
    if path in _QUANTIZED_HEADS:
        return True
    return path.startswith("stt_model.llm.layers.") and path.endswith(_QUANTIZED_SUFFIXES)


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"quantize_bits must be one of {SUPPORTED_BITS}, got {bits}")


# A checkpoint tensor as stored: ``{key: value}``, or a quantized layer's three tensors.
Quantizer = Callable[[str, mx.array], dict[str, mx.array]]


def quantize_llm_tensor(key: str, value: mx.array, bits: int | None,
                        group_size: int = QUANTIZATION_GROUP_SIZE) -> dict[str, mx.array]:
    """``{key: value}``, or a quantized LLM module's ``.weight`` / ``.scales`` / ``.biases``
    (the modules mlx-community conversions quantize, :func:`is_quantized_module`)."""
    module, _, leaf = key.rpartition(".")
    if bits is None or leaf != "weight" or not is_quantized_module(module):
        return {key: value}
    packed, scales, biases = mx.quantize(value, group_size=group_size, bits=bits)
    return {key: packed, f"{module}.scales": scales, f"{module}.biases": biases}


class ShardWriter:
    """Receives tensors one at a time (a :class:`~.tensors.Tensors` sink) and shards them."""

    def __init__(self, out_dir: Path, quantize: Quantizer | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES):
        self.out_dir = out_dir
        self.quantize = quantize
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, mx.array] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._total = 0

    def _part(self, number: int) -> Path:
        # A dot name: a loader's ``*.safetensors`` glob never picks up a partial write.
        return self.out_dir / f".shard-{number:05d}.safetensors"

    def __call__(self, name: str, value: mx.array) -> None:
        tensors = {name: value} if self.quantize is None else self.quantize(name, value)
        mx.eval(tensors)
        for key, array in tensors.items():
            self._pending[key] = array
            self._pending_bytes += array.nbytes
        if self._pending_bytes >= self.max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        part = self._part(len(self._shards) + 1)
        shard = dict(sorted(self._pending.items()))
        mx.save_safetensors(str(part), shard, metadata={"format": "mlx"})
        self._shards.append((part, list(shard)))
        self._total += self._pending_bytes
        logger.info("wrote shard %d (%.2f GiB)", len(self._shards), self._pending_bytes / 2**30)
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        """Write the last shard, give every shard its final name, and write the index."""
        self._flush()
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        for number, (part, keys) in enumerate(self._shards, start=1):
            name = WEIGHTS_FILE if count == 1 else \
                f"model-{number:05d}-of-{count:05d}.safetensors"
            part.replace(self.out_dir / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self._total},
                 "weight_map": dict(sorted(weight_map.items()))}
        text = json.dumps(index, indent=2, ensure_ascii=False)
        (self.out_dir / INDEX_FILE).write_text(text + "\n")
