"""Tiny, deterministic Nemotron VoiceChat checkpoints for tests and demos.

``make_checkpoint`` writes a directory that looks like a converted
mlx-community checkpoint (``config.json``, ``model.safetensors`` + index, the
LLM tokenizer files, ``rnnt_tokenizer/``), so both this package and the
upstream loaders can read it. The same arguments give byte-identical files.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import shutil
import tempfile
import wave
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import ModelConfig
from ..profiles import (
    CONFIG_KEY,
    Profile,
    get_profile,
    plan_layers,
    quantizable_modules,
    quantization_config,
    quantize_tensor,
    quantized_layers,
)
from .configs import DRAWN_ON_DEVICE, FULL_QUANTIZE_BITS, fixture_config
from .tokenizers import (
    build_text_tokenizer,
    train_rnnt_sentencepiece,
    write_rnnt_tokenizer,
    write_text_tokenizer,
)
from .shards import (
    INDEX_FILE,
    MAX_SHARD_BYTES,
    QUANTIZATION_GROUP_SIZE,
    SUPPORTED_BITS,
    WEIGHTS_FILE,
    Quantizer,
    ShardWriter,
    check_bits,
    is_quantized_module,
    quantize_llm_tensor,
)
from .weights import TUNINGS, build_weights

logger = logging.getLogger(__name__)

RNNT_TOKENIZER_DIR = "rnnt_tokenizer"

__all__ = ["INDEX_FILE", "QUANTIZATION_GROUP_SIZE", "SUPPORTED_BITS", "WEIGHTS_FILE",
           "is_quantized_module", "make_checkpoint", "quantize_weights"]


def quantize_weights(weights: dict[str, mx.array], bits: int,
                     group_size: int = QUANTIZATION_GROUP_SIZE) -> dict[str, mx.array]:
    """Replace each quantizable ``.weight`` by ``.weight`` / ``.scales`` / ``.biases``."""
    check_bits(bits)
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        out.update(quantize_llm_tensor(key, value, bits, group_size))
    return dict(sorted(out.items()))


def _quantizer(config: ModelConfig, raw: dict, quantize_bits: int | None,
               profile: "str | Profile | None") -> Quantizer | None:
    """How each drawn tensor is stored (``profile``, else ``quantize_bits`` for the LLM,
    else as drawn); the ``quantization`` entries it implies go into ``raw``."""
    if profile is not None:
        plans = plan_layers(profile, quantizable_modules(config))
        quantization = quantization_config(quantized_layers(plans))
        if quantization is not None:
            raw["quantization"] = dict(quantization)
            raw["quantization_config"] = dict(quantization)
        return lambda key, value: quantize_tensor(key, value, plans)
    if quantize_bits is not None:
        quantization = {"group_size": QUANTIZATION_GROUP_SIZE, "bits": quantize_bits}
        raw["quantization"] = dict(quantization)
        raw["quantization_config"] = dict(quantization)
        return lambda key, value: quantize_llm_tensor(key, value, quantize_bits)
    return None


def apply_profile(weights: dict[str, mx.array], config: ModelConfig,
                  profile: "str | Profile", raw: dict) -> dict[str, mx.array]:
    """``weights`` as ``profile`` stores them; its ``quantization`` entries go into ``raw``."""
    quantize = _quantizer(config, raw, None, profile)
    assert quantize is not None
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        out.update(quantize(key, value))
    return dict(sorted(out.items()))


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")


def make_checkpoint(out_dir: str | Path, size: str = "tiny", seed: int = 0,
                    quantize_bits: int | None = None,
                    profile: "str | Profile | None" = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write fixture checkpoint ``size`` ("tiny" | "small" | "medium" | "full") into ``out_dir``.

    ``full`` (the released 11B's shapes, about 8 GB on disk) draws its
    weights with ``mx.random`` and is quantized 4-bit like the release unless
    ``quantize_bits`` or ``profile`` says otherwise. ``profile`` (a
    :mod:`..profiles` name or :class:`~..profiles.Profile`) stores the weights
    as that profile does, instead of ``quantize_bits``. Every size takes the same path: each tensor is
    quantized and evaluated as it is drawn and shards are written as they
    fill (:class:`~.shards.ShardWriter`), so the peak is about one shard plus
    the largest tensor's draw, not the whole unquantized model.
    ``max_shard_bytes``: where a shard is cut (mlx-lm's naming past one).
    """
    if profile is not None and quantize_bits is not None:
        raise ValueError("give quantize_bits or profile, not both")
    on_device = size in DRAWN_ON_DEVICE
    if size == "full" and quantize_bits is None and profile is None:
        quantize_bits = FULL_QUANTIZE_BITS
    if quantize_bits is not None:
        check_bits(quantize_bits)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = fixture_config(size)
    config = ModelConfig.from_dict(raw)

    text = build_text_tokenizer(
        config.text_config.vocab_size,
        bos_id=config.bos_token_id,
        eos_id=config.eos_token_id,
        silence_id=config.silence_token_id,
        pad_id=config.pad_token_id,
        fill=on_device,
    )
    write_text_tokenizer(text, out)
    rnnt_vocab_size = config.audio_config.decoder.vocab_size
    if config.rnnt_blank_id != rnnt_vocab_size:
        raise ValueError("config: rnnt_blank_id must follow the RNNT vocabulary")
    spm_model = train_rnnt_sentencepiece(rnnt_vocab_size, seed=seed)
    raw["rnnt_vocabulary"] = write_rnnt_tokenizer(spm_model, out / RNNT_TOKENIZER_DIR)

    if on_device:
        logger.info("drawing the %s fixture's weights on %s", size, mx.default_device())
    writer = ShardWriter(out, _quantizer(config, raw, quantize_bits, profile), max_shard_bytes)
    build_weights(config, text.vocab, seed=seed, tuning=TUNINGS.get(size),
                  device=on_device, sink=writer)
    writer.close()
    if profile is not None:
        raw[CONFIG_KEY] = get_profile(profile).record()
    _write_json(out / "config.json", raw)
    logger.info("wrote %s fixture checkpoint to %s", size, out)
    return out


_CACHE: dict[tuple[str, int, int | None, str | None], Path] = {}


def cached_checkpoint(size: str = "tiny", seed: int = 0,
                      quantize_bits: int | None = None,
                      profile: "str | Profile | None" = None) -> Path:
    """``make_checkpoint`` once per process, under a temporary directory."""
    key = (size, seed, quantize_bits, profile)
    path = _CACHE.get(key)
    if path is None or not (path / "config.json").exists():
        if not _CACHE:
            atexit.register(clear_cache)
        root = Path(tempfile.mkdtemp(prefix="voicechat-fixture-"))
        suffix = f"-q{quantize_bits}" if quantize_bits else ""
        suffix += f"-{profile}" if profile else ""
        path = make_checkpoint(root / f"{size}-s{seed}{suffix}", size, seed, quantize_bits,
                               profile=profile)
        _CACHE[key] = path
    return path


def clear_cache() -> None:
    """Delete every checkpoint made by :func:`cached_checkpoint`."""
    for path in _CACHE.values():
        shutil.rmtree(path.parent, ignore_errors=True)
    _CACHE.clear()


def question_signal(seconds: float = 2.0, seed: int = 0,
                    sample_rate: int = 16_000) -> np.ndarray:
    """A speech-like float32 test signal: gated harmonic chirps plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * sample_rate)), dtype=np.float64) / sample_rate
    pitch = 140.0 + 60.0 * np.sin(2 * math.pi * 0.7 * t)
    phase = 2 * math.pi * np.cumsum(pitch) / sample_rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    # Syllable-rate envelope with short pauses.
    envelope = np.clip(np.sin(2 * math.pi * 2.5 * t + rng.uniform(0, math.pi)), 0, None)
    noise = rng.standard_normal(t.shape)
    signal = 0.3 * envelope * voiced + 0.02 * noise
    return (signal / max(1.0, np.abs(signal).max() / 0.9)).astype(np.float32)


def conversation_signal(seconds: float, sample_rate: int = 16_000) -> np.ndarray:
    """A long input for benchmarks: 4 s questions with 2 s pauses, cut to ``seconds``."""
    phrase = np.concatenate([question_signal(4.0, sample_rate=sample_rate),
                             np.zeros(2 * sample_rate, np.float32)])
    reps = int(np.ceil(seconds * sample_rate / len(phrase)))
    return np.tile(phrase, reps)[: int(seconds * sample_rate)]


def make_question_wav(path: str | Path, seconds: float = 2.0, seed: int = 0,
                      sample_rate: int = 16_000) -> Path:
    """Write :func:`question_signal` as a 16 kHz mono PCM16 WAV file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = np.round(question_signal(seconds, seed, sample_rate) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())
    return path


def dequantized_checkpoint(src: str | Path, out_dir: str | Path) -> Path:
    """A copy of checkpoint ``src`` with every quantized layer dequantized exactly:
    float32 weights holding ``scale * q + bias`` as the quantized kernels compute
    it (the same weights, unquantized; a bf16 copy would round them)."""
    src, out = Path(src), Path(out_dir)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", INDEX_FILE))
    raw = json.loads((src / "config.json").read_text())
    quantization = raw.pop("quantization", None) or {}
    raw.pop("quantization_config", None)
    raw.pop(CONFIG_KEY, None)  # no longer that profile's weights
    weights = {}
    for file in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    out_weights: dict[str, mx.array] = {}
    for key, value in weights.items():
        module, _, leaf = key.rpartition(".")
        quantized = f"{module}.scales" in weights
        if quantized and leaf in ("scales", "biases"):
            continue  # folded into the weight
        if not quantized or leaf != "weight":
            out_weights[key] = value
            continue
        entry = quantization.get(module)
        fmt = entry if isinstance(entry, dict) else quantization
        affine = [weights[f"{module}.{n}"].astype(mx.float32) for n in ("scales", "biases")
                  if f"{module}.{n}" in weights]
        out_weights[key] = mx.dequantize(value, *affine, group_size=fmt["group_size"],
                                         bits=fmt["bits"])
    writer = ShardWriter(out)
    for key, value in out_weights.items():
        writer(key, value)
    writer.close()
    _write_json(out / "config.json", raw)
    return out
