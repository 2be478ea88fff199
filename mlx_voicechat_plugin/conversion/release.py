"""NVIDIA's original release layout, read into the runtime's ``config.json``.

The release (``nvidia/NVIDIA-NemotronLabs-VoiceChat-11B``) holds a NeMo-style
``config.json`` (``model.stt.model`` for perception and the duplex LLM,
``model.speech_generation`` for EAR-TTS and the codec, ``_rnnt_merge_info``
for the RNNT branch, ``data`` for the rates), safetensors shards with an
index, and ``rnnt_tokenizer/``. Its tensors already carry the names the
runtime's loader reads (NeMo/PyTorch names and layouts; ``Model.sanitize``
maps them at load), so conversion renames nothing: it writes the runtime
config and the LLM tokenizer beside the weights. The LLM's own config and
tokenizer come from the Nemotron Nano 9B v2 repository
(:data:`BASE_TOKENIZER_REPO`).
"""

from __future__ import annotations

import math
from typing import Any

from ..checkpoint import MODEL_TYPE
from ..config import ModelConfig

BASE_TOKENIZER_REPO = "nvidia/NVIDIA-Nemotron-Nano-9B-v2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Keys of the base (Nemotron-H) config copied into text_config, with the older
# spellings some exports use.
_TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "max_position_embeddings", "num_attention_heads", "num_key_value_heads",
              "mamba_num_heads", "mamba_head_dim", "conv_kernel", "hybrid_override_pattern")
_TEXT_OPTIONAL = {"attention_bias": False, "mamba_proj_bias": False, "mlp_bias": False,
                  "use_bias": False, "use_conv_bias": True, "head_dim": None}
_TEXT_ALIASES = {"ssm_state_size": "mamba_state_dim", "n_groups": "mamba_num_groups",
                 "layer_norm_epsilon": "rms_norm_eps"}
# EAR-TTS backbone (a Gemma-3 config) keys the runtime reads, with the runtime's
# name where the Hugging Face one differs.
_BACKBONE_KEYS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                  "num_hidden_layers": "num_hidden_layers",
                  "num_attention_heads": "num_attention_heads",
                  "num_key_value_heads": "num_key_value_heads", "head_dim": "head_dim",
                  "sliding_window": "sliding_window",
                  "sliding_window_pattern": "sliding_window_pattern",
                  "rms_norm_eps": "rms_norm_eps", "query_pre_attn_scalar": "query_pre_attn_scalar",
                  "rope_theta": "rope_global_base_freq",
                  "rope_local_base_freq": "rope_local_base_freq"}
_TTS_KEYS = ("latent_size", "num_quantizers", "codebook_size", "num_delay_speech_tokens",
             "exponent", "disable_eos_prediction", "use_gated_fusion_for_text_audio",
             "use_subword_flag_emb", "use_bos_eos_emb", "use_audio_prompt_frozen_projection",
             "num_iterations")
_CODEC_KEYS = {"base_hidden_size": "base_channels", "channel_mult": "channel_multipliers",
               "rates": "downsample_rates", "num_blocks": "blocks_per_stage",
               "kernel_size": "block_kernel_size", "latent_size": "latent_dim",
               "n_fft": "n_fft", "hop_length": "hop_length", "num_quantizers": "num_quantizers",
               "codebook_size": "codebook_size"}
# The release's voice, and the RNNT's greedy symbol limit per frame.
RELEASE_SPEAKER = "Aria"
MAX_SYMBOLS = 10


def is_release_config(values: dict[str, Any]) -> bool:
    """Whether ``config.json`` contents are the release's NeMo-style config."""
    model = values.get("model")
    return isinstance(model, dict) and "stt" in model and "speech_generation" in model


def _required(values: dict[str, Any], *path: str) -> Any:
    node: Any = values
    for depth, key in enumerate(path):
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"release config.json: missing {'.'.join(path[: depth + 1])}")
        node = node[key]
    return node


def text_config(base: dict[str, Any]) -> dict[str, Any]:
    """``text_config`` from the Nemotron Nano 9B v2 ``config.json``."""
    config: dict[str, Any] = {"model_type": "nemotron_h"}
    for key in _TEXT_KEYS:
        if key not in base:
            raise ValueError(f"tokenizer config.json (Nemotron-H): missing {key}")
        config[key] = base[key]
    for key, alias in _TEXT_ALIASES.items():
        if key in base or alias in base:
            config[key] = base.get(key, base.get(alias))
    for key, default in _TEXT_OPTIONAL.items():
        config[key] = base.get(key, default)
    limit = base.get("time_step_limit")
    if limit is not None:
        # (min, max) clamp of the Mamba2 step; the (0, inf) default is left out
        # rather than written as the non-standard JSON token Infinity.
        if (not isinstance(limit, (list, tuple)) or len(limit) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                           for v in limit)):
            raise ValueError("tokenizer config.json: time_step_limit must be two numbers")
        if all(math.isfinite(v) for v in limit):
            config["time_step_limit"] = list(limit)
    return config


def runtime_config(source: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The runtime's ``config.json`` from the release's and the base LLM's configs."""
    voicechat = _required(source, "model")
    stt = _required(source, "model", "stt", "model")
    speech = _required(source, "model", "speech_generation", "model")
    perception = _required(stt, "perception")
    rnnt = _required(source, "_rnnt_merge_info")
    decoder_source = _required(rnnt, "decoder_config")
    joint_source = _required(rnnt, "joint_config")
    tts_source = _required(speech, "tts_config")
    backbone = _required(tts_source, "backbone_config")
    codec = _required(speech, "codec_config")
    speech_data = _required(voicechat, "speech_generation", "data")

    encoder = {k: v for k, v in _required(perception, "encoder").items() if k != "_target_"}
    preprocessor = {k: v for k, v in _required(perception, "preprocessor").items()
                    if k != "_target_"}
    decoder = {**_required(decoder_source, "prednet"),
               "vocab_size": _required(decoder_source, "vocab_size"),
               "blank_as_pad": decoder_source.get("blank_as_pad", True)}
    joint = {**_required(joint_source, "jointnet"),
             "num_classes": _required(joint_source, "num_classes")}
    tts = {ours: backbone[theirs] for theirs, ours in _BACKBONE_KEYS.items() if theirs in backbone}
    tts.update({key: tts_source[key] for key in _TTS_KEYS if key in tts_source})
    tts.update({
        "character_encoder": dict(_required(tts_source, "cas_config", "backbone_config",
                                            "encoder")),
        "mog_head": dict(_required(tts_source, "mog_head_config")),
        "guidance_scale": _required(speech, "inference_guidance_scale"),
        "top_p": _required(speech, "inference_top_p_or_k"),
        "noise_scale": _required(speech, "inference_noise_scale"),
        "audio_prompt_duration": _required(speech_data, "audio_prompt_duration"),
    })
    codec_config = {ours: codec[theirs] for theirs, ours in _CODEC_KEYS.items()
                    if theirs in codec}
    codec_config["sample_rate"] = _required(speech_data, "target_sample_rate")
    data = _required(source, "data")
    defaults = ModelConfig.__dataclass_fields__
    config = {
        "model_type": MODEL_TYPE,
        "architectures": ["NemotronVoiceChatForConditionalGeneration"],
        "text_config": text_config(base),
        "audio_config": {"preprocessor": preprocessor, "encoder": encoder, "decoder": decoder,
                         "joint": joint, "output_dim": _required(perception, "output_dim"),
                         "max_symbols": MAX_SYMBOLS},
        "tts_config": tts,
        "codec_config": codec_config,
        # The Nemotron tokenizer's sentinel ids (ModelConfig names them once).
        **{name: defaults[name].default for name in
           ("bos_token_id", "eos_token_id", "pad_token_id", "silence_token_id")},
        # The RNNT's blank follows its vocabulary.
        "rnnt_blank_id": decoder["vocab_size"],
        "input_sample_rate": _required(data, "source_sample_rate"),
        "output_sample_rate": _required(data, "target_sample_rate"),
        "frame_duration": _required(data, "frame_length"),
        "function_channel_weight": _required(stt, "duplex_function_channel_weight"),
        "speaker": RELEASE_SPEAKER,
        "rnnt_vocabulary": list(joint_source.get("vocabulary", [])),
    }
    quantization = source.get("mlx_conversion", {}).get("quantization")
    if quantization:
        config["quantization"] = {"group_size": quantization["group_size"],
                                  "bits": quantization["bits"],
                                  **quantization.get("modules", {})}
    return config
