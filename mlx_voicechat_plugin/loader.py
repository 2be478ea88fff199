"""``load(path_or_repo)``: a VoiceChat checkpoint as ``(model, processor)``.

Strict: every checkpoint tensor must land on a parameter and every parameter
must be in the checkpoint. Quantized checkpoints quantize exactly the modules
that carry ``.scales`` (the LLM: embedding, both heads, Nemotron-H mixer
projections) or that the config's quantization map names.
"""

from __future__ import annotations

import glob
import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .budget import plan_memory, wire
from .checkpoint import CheckpointError, check_checkpoint, resolve_path
from .config import ModelConfig
from .models.model import Model

logger = logging.getLogger(__name__)

# Weights whose activations are float32: holding them in float32 is an exact
# conversion (MLX would upcast bf16 on every matmul) and saves that work.
F32_HOLD_PREFIXES = (
    "stt_model.perception.",
    "stt_model.rnnt_joint.",  # encoder frames and (upcast) predictions are float32
    "tts_model.tts_model.backbone.",
    "tts_model.tts_model.mog_head.",
    "tts_model.tts_model.embed_code.",  # summed code latents are float32
    "tts_model.tts_model.gated_fusion_audio_text.audio_proj.",
)
# The LLM reads float32 fused embeddings, so the same holds for it, at twice
# the memory of bf16: it is held in float32 only while its stored weights are
# at most this size (small and test models; the released 11B is far above it
# and its 4-bit release is quantized anyway).
LLM_F32_HOLD_PREFIXES = (
    "stt_model.llm.",
    "stt_model.embed_tokens.",
    "stt_model.lm_head.",
    "stt_model.function_head.",
)
LLM_F32_HOLD_MAX_BYTES = 2 * 2**30
# Quantized layers' scales and biases feed the quantized kernels as stored.
_QUANTIZATION_PARAMS = (".scales", ".biases")


def _keeps_stored_dtype(key: str) -> bool:
    # Gemma-style norms compute ``1 + w`` in the weight's dtype: upcasting
    # them would change the rounding, so norm weights stay as stored.
    return any("norm" in part for part in key.split("."))


def plain_cause(error: BaseException) -> bool:
    """Whether a load's ``error`` is the user's to fix, its message enough (a
    checkpoint not whole, a budget it does not fit, a file it cannot read); else a bug."""
    from .budget import BudgetExceeded

    return isinstance(error, (CheckpointError, BudgetExceeded, OSError))


def read_weights(path: Path) -> dict[str, mx.array]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [str(path / s) for s in shards]
    else:
        files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(file))
    return weights


def quantize_like_checkpoint(
    model: nn.Module, quantization: dict[str, Any], weights: dict[str, mx.array]
) -> None:
    """Swap in quantized layers exactly where the checkpoint has them."""

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if isinstance(quantization.get(path), dict):
            return quantization[path]
        return hasattr(module, "to_quantized") and f"{path}.scales" in weights

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def float32_holds(model: nn.Module) -> list[tuple[str, mx.array]]:
    """The half-precision weights held as float32 copies where the budget allows
    (see ``F32_HOLD_PREFIXES``)."""
    params = tree_flatten(model.parameters())
    halves = [
        (k, v) for k, v in params
        if v.dtype in (mx.bfloat16, mx.float16)
        and not _keeps_stored_dtype(k)
        and not k.endswith(_QUANTIZATION_PARAMS)
    ]
    prefixes = F32_HOLD_PREFIXES
    llm_bytes = sum(v.nbytes for k, v in params if k.startswith(LLM_F32_HOLD_PREFIXES))
    if llm_bytes <= LLM_F32_HOLD_MAX_BYTES:
        prefixes += LLM_F32_HOLD_PREFIXES
    else:
        logger.info("LLM weights (%.1f GiB) stay as stored", llm_bytes / 2**30)
    return [(k, v) for k, v in halves if k.startswith(prefixes)]


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # AutoTokenizer reads config.json and warns that it does not know this
    # model type; the tokenizer files are all it needs.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(path))
    finally:
        hf_logging.set_verbosity(verbosity)


def load_model(path: Path, lazy: bool = False, hold_f32: bool | None = None,
               memory_budget: float | None = None) -> Model:
    """The model of checkpoint ``path``, planned against ``memory_budget`` (GiB;
    :mod:`.budget`): ``hold_f32`` ``None`` lets the budget decide whether the
    float32 copies are held (never for a checkpoint whose profile is memory
    first, ``profiles.Profile.memory_first``), ``True`` / ``False`` decides it. The plan is
    ``model.memory_plan``; a checkpoint that cannot fit is refused
    (:class:`~.budget.BudgetExceeded`) before any weight is read."""
    config = ModelConfig.from_dict(check_checkpoint(path))
    model = Model(config)
    weights = model.sanitize(read_weights(path))
    quantization = config.quantization or config.quantization_config
    if quantization:
        quantize_like_checkpoint(model, quantization, weights)
    model.load_weights(list(weights.items()), strict=True)
    del weights
    stored = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    holds = float32_holds(model)
    if hold_f32 is None and config.memory_first:
        hold_f32 = False
        logger.info("the checkpoint's %r profile is memory first: no float32 copies held "
                    "(hold_f32=True holds them)", config.voicechat_profile.get("name"))
    plan = plan_memory(config, stored, sum(v.nbytes for _, v in holds), memory_budget,
                       hold_f32)
    if plan.hold_f32 and holds:
        model.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in holds]))
    del holds
    if not lazy:
        mx.eval(model.parameters())
    wire(plan)
    model.eval()
    model.model_path = path  # type: ignore[attr-defined]
    model.memory_plan = plan  # type: ignore[attr-defined]
    # The checkpoint its weights are, until they are replaced (``Model.update``):
    # what is remembered of a checkpoint (:mod:`.models.remembered`) is keyed on it.
    model.checkpoint_path = path  # type: ignore[attr-defined]
    return model


def load(
    path_or_repo: str | Path, lazy: bool = False, hold_f32: bool | None = None,
    memory_budget: float | None = None,
) -> tuple[Model, Any]:
    """Load a Nemotron VoiceChat checkpoint and its tokenizer.

    ``memory_budget``: the GiB the model and its sessions may use (default: the
    device's, :func:`~.budget.device_memory`); it decides whether float32 copies
    of the float32-activation weights are held (``hold_f32`` forces it) and
    refuses a checkpoint that cannot fit, naming the profile that would.
    """
    path = resolve_path(path_or_repo)
    model = load_model(path, lazy=lazy, hold_f32=hold_f32, memory_budget=memory_budget)
    tokenizer = load_tokenizer(path)
    model.prepare(tokenizer)
    return model, tokenizer
