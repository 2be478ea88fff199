"""Fixture checkpoints in NVIDIA's original release layout, for converter tests.

:func:`make_release_checkpoint` writes the same random weights as
:func:`~.fixtures.make_checkpoint` (same size and seed) as the release lays
them out: a NeMo-style ``config.json`` (what :mod:`..conversion.release`
reads), several safetensors shards with an index, ``rnnt_tokenizer/``; and,
in a second folder, the LLM's own config and tokenizer as the Nemotron Nano
9B v2 repository holds them. A conversion of it can then be compared with
the fixture factory's own checkpoint of a profile.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from .fixtures import RNNT_TOKENIZER_DIR, make_checkpoint

RELEASE_SHARDS = 3
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class ReleaseFixture:
    source: Path  # the release folder
    tokenizer: Path  # the Nemotron Nano 9B v2 config and tokenizer


def base_config(text: dict[str, Any]) -> dict[str, Any]:
    """The Nemotron Nano 9B v2 ``config.json`` for ``text_config``: Hugging Face's
    ``nemotron_h`` names, with the Mamba sizes also under the names upstream's
    converter reads (``mamba_state_dim``, ``mamba_num_groups``)."""
    values = {k: v for k, v in text.items() if k != "model_type"}
    return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
            "rms_norm_eps": values.pop("layer_norm_epsilon"),
            "mamba_state_dim": values["ssm_state_size"],
            "mamba_num_groups": values["n_groups"],
            "time_step_min": 0.001, "time_step_max": 0.1, **values}


def release_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The release's NeMo-style ``config.json`` holding runtime config ``raw``."""
    audio, tts, codec = raw["audio_config"], dict(raw["tts_config"]), raw["codec_config"]
    backbone = {k: tts.pop(k) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "sliding_window", "sliding_window_pattern",
        "rms_norm_eps", "query_pre_attn_scalar", "rope_local_base_freq")}
    backbone["rope_theta"] = tts.pop("rope_global_base_freq")
    decoder = dict(audio["decoder"])
    joint = dict(audio["joint"])
    return {
        "model": {
            "stt": {"model": {
                "perception": {
                    "preprocessor": {"_target_": "AudioToMelSpectrogramPreprocessor",
                                     **audio["preprocessor"]},
                    "encoder": {"_target_": "ConformerEncoder", **audio["encoder"]},
                    "output_dim": audio["output_dim"],
                },
                "duplex_function_channel_weight": raw["function_channel_weight"],
            }},
            "speech_generation": {
                "model": {
                    "tts_config": {
                        "backbone_config": backbone,
                        "cas_config": {"backbone_config": {"encoder": tts.pop(
                            "character_encoder")}},
                        "mog_head_config": tts.pop("mog_head"),
                        **{k: tts[k] for k in (
                            "latent_size", "num_quantizers", "codebook_size",
                            "num_delay_speech_tokens", "exponent", "disable_eos_prediction",
                            "use_gated_fusion_for_text_audio", "use_subword_flag_emb",
                            "use_bos_eos_emb", "use_audio_prompt_frozen_projection",
                            "num_iterations")},
                    },
                    "codec_config": {
                        "base_hidden_size": codec["base_channels"],
                        "channel_mult": codec["channel_multipliers"],
                        "rates": codec["downsample_rates"],
                        "num_blocks": codec["blocks_per_stage"],
                        "kernel_size": codec["block_kernel_size"],
                        "latent_size": codec["latent_dim"], "n_fft": codec["n_fft"],
                        "hop_length": codec["hop_length"],
                        "num_quantizers": codec["num_quantizers"],
                        "codebook_size": codec["codebook_size"],
                    },
                    "inference_guidance_scale": tts["guidance_scale"],
                    "inference_top_p_or_k": tts["top_p"],
                    "inference_noise_scale": tts["noise_scale"],
                },
                "data": {"audio_prompt_duration": tts["audio_prompt_duration"],
                         "target_sample_rate": codec["sample_rate"]},
            },
        },
        "_rnnt_merge_info": {
            "decoder_config": {"prednet": {k: decoder.pop(k) for k in (
                "pred_hidden", "pred_rnn_layers")}, **decoder},
            "joint_config": {"jointnet": {k: v for k, v in joint.items()
                                          if k != "num_classes"},
                             "num_classes": joint["num_classes"],
                             "vocabulary": raw["rnnt_vocabulary"]},
        },
        "data": {"source_sample_rate": raw["input_sample_rate"],
                 "target_sample_rate": raw["output_sample_rate"],
                 "frame_length": raw["frame_duration"]},
    }


def _write_shards(weights: dict[str, mx.array], out: Path, shards: int) -> None:
    keys = sorted(weights)
    per = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in keys[i * per : (i + 1) * per]}
        mx.save_safetensors(str(out / name), part, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(v.nbytes for v in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_release_checkpoint(out_dir: str | Path, size: str = "tiny", seed: int = 0,
                            shards: int = RELEASE_SHARDS) -> ReleaseFixture:
    """Fixture ``size`` / ``seed`` in the release layout under ``out_dir``: ``release/``
    and ``tokenizer/`` (bf16 weights, as the release stores them)."""
    out = Path(out_dir)
    source, tokenizer = out / "release", out / "tokenizer"
    source.mkdir(parents=True)
    tokenizer.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        mlx = make_checkpoint(Path(scratch) / "mlx", size, seed)
        raw = json.loads((mlx / "config.json").read_text())
        weights = mx.load(str(mlx / "model.safetensors"))
        _write_shards(weights, source, shards)
        (source / "config.json").write_text(json.dumps(release_config(raw), indent=2) + "\n")
        shutil.copytree(mlx / RNNT_TOKENIZER_DIR, source / RNNT_TOKENIZER_DIR)
        for name in _TOKENIZER_FILES:
            shutil.copy2(mlx / name, tokenizer / name)
        (tokenizer / "config.json").write_text(
            json.dumps(base_config(raw["text_config"]), indent=2) + "\n")
    return ReleaseFixture(source, tokenizer)
