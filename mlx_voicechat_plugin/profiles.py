"""Precision profiles: which part of a VoiceChat checkpoint is stored in which format.

A checkpoint is cut into parts by key prefix (:data:`PARTS`: the language model,
the speech encoder, the RNNT branch, the EAR-TTS backbone, its MoG head, its
text inputs, the codec, the rest). A :class:`Profile` gives each part a
:class:`Format`: as stored, bf16, or quantized (bits, group size). Only the
modules the runtime can quantize (its ``nn.Linear`` / ``nn.Embedding`` layers,
:func:`quantizable_modules`) change; norms, convolutions, LSTMs, codebooks and
buffers always stay as stored.

``release`` is the ``-4bit`` release (LLM 4-bit, the rest as stored); ``lean``
also quantizes the encoder (8-bit) and the EAR-TTS backbone and MoG head
(4-bit), ``balanced`` the same parts 8-bit (the choice of bits, and the
agreement each keeps, are measured in docs/checkpoints.md); ``q8`` quantizes
the LLM too at 8 bits; ``bf16`` stores every layer unquantized.

Per-layer quantization is written to ``config.json`` as mlx-lm writes it
(:func:`quantization_config`): a default ``group_size`` / ``bits`` and one entry
per module path that differs from it.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import mlx.core as mx

    from .config import ModelConfig

logger = logging.getLogger(__name__)

# The config.json key a converted checkpoint records its profile under (:meth:`Profile.record`).
CONFIG_KEY = "voicechat_profile"
STORED, BF16, QUANTIZED = "stored", "bf16", "quantized"
FORMAT_KINDS = (STORED, BF16, QUANTIZED)
SUPPORTED_BITS = (4, 8)
# MLX's affine quantization groups; a layer whose input width no group divides stays as stored.
SUPPORTED_GROUP_SIZES = (128, 64, 32)
DEFAULT_GROUP_SIZE = 64
QUANTIZATION_MODE = "affine"


@dataclass(frozen=True)
class Format:
    """How a part's quantizable layers are stored."""

    kind: str = STORED
    bits: int | None = None
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.kind not in FORMAT_KINDS:
            raise ValueError(f"format kind must be one of {FORMAT_KINDS}, got {self.kind!r}")
        if self.kind == QUANTIZED:
            if self.bits not in SUPPORTED_BITS:
                raise ValueError(f"format bits must be one of {SUPPORTED_BITS}, got {self.bits!r}")
            if self.group_size not in SUPPORTED_GROUP_SIZES:
                raise ValueError(f"format group_size must be one of {SUPPORTED_GROUP_SIZES}, "
                                 f"got {self.group_size!r}")

    @classmethod
    def from_value(cls, value: "str | Mapping[str, Any] | Format") -> "Format":
        """``"stored"``, ``"bf16"``, ``"q4"`` / ``"q8"``, or ``{"bits": 4, "group_size": 64}``."""
        if isinstance(value, Format):
            return value
        if isinstance(value, str):
            if value in (STORED, BF16):
                return cls(value)
            if value.startswith("q") and value[1:].isdigit():
                return cls(QUANTIZED, int(value[1:]))
            raise ValueError(f"format must be 'stored', 'bf16', 'q4' or 'q8', got {value!r}")
        if isinstance(value, Mapping):
            return cls(QUANTIZED, value.get("bits"),
                       value.get("group_size", DEFAULT_GROUP_SIZE))
        raise TypeError(f"format must be a string or a mapping, got {type(value).__name__}")

    @property
    def quantized(self) -> bool:
        return self.kind == QUANTIZED

    def group_for(self, in_dim: int) -> int | None:
        """The largest supported group size, at most this format's, that divides ``in_dim``."""
        for group in SUPPORTED_GROUP_SIZES:
            if group <= self.group_size and in_dim % group == 0:
                return group
        return None

    @property
    def label(self) -> str:
        if self.kind == QUANTIZED:
            return f"{self.bits}-bit g{self.group_size}"
        return "as stored" if self.kind == STORED else "bf16"


@dataclass(frozen=True)
class Part:
    """Checkpoint keys under any of ``prefixes`` (dotted module paths)."""

    name: str
    prefixes: tuple[str, ...]
    description: str


PARTS: tuple[Part, ...] = (
    Part("llm", ("stt_model.llm.", "stt_model.embed_tokens.", "stt_model.lm_head.",
                 "stt_model.function_head."), "Nemotron-H language model, embedding, heads"),
    Part("encoder", ("stt_model.perception.",), "FastConformer encoder and projection"),
    Part("rnnt", ("stt_model.rnnt_decoder.", "stt_model.rnnt_joint."), "RNNT transcript branch"),
    Part("tts_backbone", ("tts_model.tts_model.backbone.",), "EAR-TTS Gemma-3 backbone"),
    Part("mog_head", ("tts_model.tts_model.mog_head.",), "EAR-TTS mixture-of-Gaussians head"),
    Part("tts_inputs", ("tts_model.tts_model.",),
         "EAR-TTS character encoder, gated fusion, code embedding"),
    Part("codec", ("tts_model.audio_codec.",), "audio codec"),
    Part("other", ("",), "buffers, prompts, control codes"),
)
PART_NAMES = tuple(part.name for part in PARTS)


def part_of(key: str) -> Part:
    """The part holding checkpoint key (or module path) ``key``: the first whose prefix matches."""
    dotted = key + "."
    for part in PARTS:
        if dotted.startswith(part.prefixes):
            return part
    raise AssertionError("the last part matches every key")


@dataclass(frozen=True)
class Profile:
    """A :class:`Format` per part (parts not named are as stored).

    ``memory_first``: the profile exists to stay small, so a checkpoint of it is
    loaded without the float32 copies whatever the budget (``loader``; its
    config.json records it, :data:`CONFIG_KEY`)."""

    name: str
    description: str
    formats: Mapping[str, Format] = field(default_factory=dict)
    memory_first: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.formats) - set(PART_NAMES))
        if unknown:
            raise ValueError(f"profile {self.name!r}: unknown part(s) {unknown}; "
                             f"parts are {', '.join(PART_NAMES)}")
        object.__setattr__(self, "formats", MappingProxyType(
            {part: Format.from_value(value) for part, value in self.formats.items()}))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Profile":
        """``{"name": ..., "description": ..., "parts": {"llm": "q4", "encoder": {"bits": 8}}}``."""
        if "name" not in values:
            raise ValueError("profile: 'name' is required")
        memory_first = values.get("memory_first", False)
        if not isinstance(memory_first, bool):
            raise ValueError(f"profile: 'memory_first' must be true or false, got {memory_first!r}")
        return cls(str(values["name"]), str(values.get("description", "")),
                   dict(values.get("parts", {})), memory_first)

    def to_dict(self) -> dict[str, Any]:
        parts: dict[str, Any] = {}
        for name, fmt in self.formats.items():
            parts[name] = ({"bits": fmt.bits, "group_size": fmt.group_size}
                           if fmt.quantized else fmt.kind)
        return {"name": self.name, "description": self.description, "parts": parts,
                "memory_first": self.memory_first}

    def record(self) -> dict[str, Any]:
        """What a checkpoint's config.json keeps of its profile (:data:`CONFIG_KEY`)."""
        return {"name": self.name, "memory_first": self.memory_first}

    def format_of(self, key: str) -> Format:
        """The format of the part holding ``key``."""
        return self.formats.get(part_of(key).name, Format())


_Q4, _Q8 = Format(QUANTIZED, 4), Format(QUANTIZED, 8)
_Q4_G128 = Format(QUANTIZED, 4, 128)

# ``lean`` is memory first: the float32 copies of its unquantized float32-activation
# layers (0.21 GiB at full size) would take it past those 6.5 GiB.
# ``lean``'s EAR-TTS bits and LLM group size were chosen by measurement
# (docs/checkpoints.md): at full size 8-bit EAR-TTS parts leave the profile at
# 6.89 GiB of weights and 4-bit ones with a g64 LLM at 6.55 GiB, both above the
# 6.5 GiB a 16 GB Mac's lean profile must stay under; 4-bit EAR-TTS with a
# g128 LLM is 6.33 GiB. ``balanced`` keeps 8-bit EAR-TTS (6.89 GiB).
PROFILES: Mapping[str, Profile] = MappingProxyType({p.name: p for p in (
    Profile("release", "as the -4bit release: LLM 4-bit, the rest as stored", {"llm": _Q4}),
    Profile("lean", "LLM 4-bit (group 128); encoder 8-bit; EAR-TTS backbone and MoG head "
                    "4-bit; RNNT, codec and norms as stored; no float32 copies held",
            {"llm": _Q4_G128, "encoder": _Q8, "tts_backbone": _Q4, "mog_head": _Q4},
            memory_first=True),
    Profile("balanced", "LLM 4-bit; encoder, EAR-TTS backbone and MoG head 8-bit; "
                        "RNNT, codec and norms as stored",
            {"llm": _Q4, "encoder": _Q8, "tts_backbone": _Q8, "mog_head": _Q8}),
    Profile("q8", "LLM, encoder, EAR-TTS backbone and MoG head 8-bit; the rest as stored",
            {"llm": _Q8, "encoder": _Q8, "tts_backbone": _Q8, "mog_head": _Q8}),
    Profile("bf16", "every layer bf16, none quantized",
            {name: Format(BF16) for name in PART_NAMES}),
)})


def get_profile(name: "str | Profile") -> Profile:
    """Profile ``name``; an unknown name is an error listing the known ones."""
    if isinstance(name, Profile):
        return name
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; known profiles: {', '.join(PROFILES)}")
    return PROFILES[name]


def quantizable_modules(config: "ModelConfig") -> dict[str, int]:
    """Module path -> input width of every layer the runtime can run quantized.

    Read off the model itself (its ``nn.Linear`` / ``nn.Embedding`` layers; the
    parameters are drawn lazily and never evaluated, so this is cheap at full size).
    """
    from .models.model import Model

    model = Model(config)
    return {path: int(module.weight.shape[-1]) for path, module in model.named_modules()
            if hasattr(module, "to_quantized") and hasattr(module, "weight")}


@dataclass(frozen=True)
class LayerPlan:
    """What a profile does to one quantizable layer: its format and the group size used."""

    path: str
    format: Format
    group_size: int | None  # None: the format is not quantized, or no group divides the width

    @property
    def quantized(self) -> bool:
        return self.format.quantized and self.group_size is not None


def plan_layers(profile: "str | Profile", modules: Mapping[str, int]) -> dict[str, LayerPlan]:
    """Each quantizable module's :class:`LayerPlan` under ``profile``."""
    profile = get_profile(profile)
    plans = {}
    for path, in_dim in modules.items():
        fmt = profile.format_of(path)
        group = fmt.group_for(in_dim) if fmt.quantized else None
        if fmt.quantized and group is None:
            logger.debug("%s: input width %d fits no quantization group; kept as stored",
                         path, in_dim)
        plans[path] = LayerPlan(path, fmt, group)
    return plans


def quantization_config(layers: Mapping[str, tuple[int, int]]) -> dict[str, Any] | None:
    """The ``quantization`` dict of ``config.json``, as mlx-lm writes it.

    ``layers``: quantized module path -> ``(bits, group_size)``. The most common
    pair is the default; each module with another pair gets its own entry.
    None where nothing is quantized.
    """
    if not layers:
        return None
    (bits, group), _ = Counter(layers.values()).most_common(1)[0]
    config: dict[str, Any] = {"group_size": group, "bits": bits, "mode": QUANTIZATION_MODE}
    for path in sorted(layers):
        if layers[path] != (bits, group):
            config[path] = {"group_size": layers[path][1], "bits": layers[path][0],
                            "mode": QUANTIZATION_MODE}
    return config


def quantize_tensor(key: str, value: "mx.array",
                    plans: Mapping[str, LayerPlan]) -> dict[str, "mx.array"]:
    """Checkpoint tensor ``key`` as the profile stores it: a planned layer's
    ``.weight`` becomes ``.weight`` / ``.scales`` / ``.biases``; anything else as is."""
    import mlx.core as mx

    module, _, leaf = key.rpartition(".")
    plan = plans.get(module)
    if leaf != "weight" or plan is None or not plan.quantized:
        return {key: value}
    packed, scales, biases = mx.quantize(value, group_size=plan.group_size,
                                         bits=plan.format.bits, mode=QUANTIZATION_MODE)
    return {key: packed, f"{module}.scales": scales, f"{module}.biases": biases}


def quantized_layers(plans: Mapping[str, LayerPlan]) -> dict[str, tuple[int, int]]:
    """Module path -> ``(bits, group_size)`` of every layer ``plans`` quantize."""
    return {path: (plan.format.bits, plan.group_size)  # type: ignore[misc]
            for path, plan in plans.items() if plan.quantized}
