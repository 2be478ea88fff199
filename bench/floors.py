"""Per-stage matmul floors: what a frame would cost if it were only its matrix products.

A stage's multiply-accumulates per frame are counted from the loaded model's
weight matrices (a rough count: every 2-D weight of a stage's linear layers,
times the rows it multiplies per frame), and divided by this machine's
measured float32 matmul throughput at frame-like shapes. The gap between a
stage's measured time and its floor is its non-matmul work and recomputation.
Embedding tables are excluded (a frame looks up rows, it does not multiply).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten


def _matrix_macs(module: Any, skip: tuple[str, ...] = ()) -> int:
    """Multiply-accumulates of one row through every 2-D weight of ``module``."""
    total = 0
    for name, value in tree_flatten(module.parameters()):
        if value.ndim == 2 and name.endswith("weight") and not any(s in name for s in skip):
            total += value.size
    return total


def stage_macs(model: Any) -> dict[str, float]:
    """Rough multiply-accumulates per 80 ms frame of each stage."""
    stt, tts = model.stt_model, model.tts_model.tts_model
    config = model.config
    window = config.audio_config.encoder.att_context_size[0][0] + 1
    encoder = _matrix_macs(stt.perception, skip=("embed",))
    # Per frame the encoder projects one new row through every layer and, as
    # the reference does, K/V for the whole attention window; the floor counts
    # one row (the K/V rows cached).
    depth = sum(1 for count in tts._schedule if count)
    return {
        "perception": float(encoder),
        "perception_window_kv": float(encoder + _kv_macs(stt.perception) * (window - 1)),
        "rnnt": float((_matrix_macs(stt.rnnt_decoder) + _matrix_macs(stt.rnnt_joint))
                      * config.audio_config.max_symbols),
        "language": float(_matrix_macs(stt.llm) + stt.lm_head.weight.size
                          + stt.function_head.weight.size),
        # CFG runs the backbone and the depth head on two rows.
        "tts": float(2 * _matrix_macs(tts.backbone, skip=("embed_tokens",))
                     + 2 * depth * _matrix_macs(tts.mog_head)),
    }


def _kv_macs(perception: Any) -> int:
    total = 0
    for name, value in tree_flatten(perception.parameters()):
        if value.ndim == 2 and (".linear_k." in name or ".linear_v." in name):
            total += value.size
    return total


def matmul_throughput(width: int = 768, out: int = 2304, rows: int = 2, repeats: int = 200) -> float:
    """Measured multiply-accumulates per second of a ``rows x width @ width x out`` float32 matmul."""
    a = mx.random.normal((rows, width))
    b = mx.random.normal((width, out))
    mx.eval(a, b, a @ b)
    began = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    return rows * width * out * repeats / (time.perf_counter() - began)


def floors_ms(model: Any) -> dict[str, Any]:
    rate = matmul_throughput()
    macs = stage_macs(model)
    return {"macs_per_second": rate, "macs": macs,
            "floor_ms": {k: v / rate * 1e3 for k, v in macs.items()}}
