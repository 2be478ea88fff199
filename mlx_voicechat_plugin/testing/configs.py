"""config.json contents of the fixture checkpoints.

``tiny`` matches ``shared/reference/checkpoint_layout_tiny.txt`` key for key;
``small`` keeps the real layer mix at benchmark-friendly widths; ``medium``
has the released checkpoint's proportions, for benchmarks where compute
dominates (``python -m bench.compare --size medium``); ``full`` has the
released 11B's shapes exactly (its LLM quantized 4-bit, group 64, like the
``-4bit`` release; about 10.7 GiB), for the GPU bench (``python -m bench.gpu``):
its weights are drawn on the device, and no test builds it on a CPU.
"""

from __future__ import annotations

import copy
from typing import Any

# Layer mix of the released Nemotron-H backbone: Mamba2 (M), attention (*), MLP (-).
_REAL_PATTERN_PREFIX = "M-M-M-M*-M-M-M-"

RNNT_VOCAB_SIZE_TINY = 64


# The released backbone's whole layer pattern (56 layers: 27 Mamba2, 4 attention, 25 MLP).
RELEASED_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
# ``full`` is quantized like the -4bit release (make_checkpoint's default for it).
FULL_QUANTIZE_BITS = 4
# Sizes whose weights are drawn with mx.random on the device, not numpy on the host.
DRAWN_ON_DEVICE = frozenset({"full"})


def _text_config(hidden: int, pattern: str, heads: int, kv_heads: int, *,
                 head_dim: int | None = None, mamba_heads: int | None = None,
                 mamba_head_dim: int = 16, ssm_state: int = 16, groups: int = 2,
                 vocab: int = 1024, intermediate: int | None = None) -> dict:
    head_dim = head_dim or hidden // heads
    return {
        "model_type": "nemotron_h",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate or 2 * hidden,
        "num_hidden_layers": len(pattern),
        "max_position_embeddings": 8192,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "attention_bias": False,
        "mamba_num_heads": mamba_heads or hidden // mamba_head_dim,
        "mamba_head_dim": mamba_head_dim,
        "mamba_proj_bias": False,
        "ssm_state_size": ssm_state,
        "conv_kernel": 4,
        "n_groups": groups,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": pattern,
        "head_dim": head_dim,
    }


def _audio_config(d_model: int, layers: int, heads: int, output_dim: int) -> dict:
    return {
        "preprocessor": {
            "sample_rate": 16000,
            "features": 128,
            "n_fft": 512,
            "window_size": 0.025,
            "window_stride": 0.01,
            "window": "hann",
            "preemph": 0.97,
            "dither": 1e-05,
            "normalize": "NA",
            "log_zero_guard_value": 2.0**-24,
            "pad_to": 0,
            "pad_value": 0.0,
            "pad_mode": "reflect",
        },
        "encoder": {
            "feat_in": 128,
            "n_layers": layers,
            "d_model": d_model,
            "n_heads": heads,
            "ff_expansion_factor": 4,
            "subsampling_factor": 8,
            "subsampling_conv_channels": 8 if d_model <= 32 else 16,
            "conv_kernel_size": 9,
            "causal_downsampling": True,
            "conv_context_size": "causal",
            "conv_norm_type": "layer_norm",
            "self_attention_model": "rel_pos",
            "att_context_style": "chunked_limited",
            "att_context_size": [[70, 0]],
            "pos_emb_max_len": 5000,
            "use_bias": False,
            "xscaling": False,
        },
        "decoder": {
            "pred_hidden": d_model,
            "pred_rnn_layers": 2,
            "vocab_size": RNNT_VOCAB_SIZE_TINY,
            "blank_as_pad": True,
        },
        "joint": {
            "joint_hidden": d_model,
            "activation": "relu",
            "encoder_hidden": d_model,
            "pred_hidden": d_model,
            "num_classes": RNNT_VOCAB_SIZE_TINY,
        },
        "output_dim": output_dim,
        "max_symbols": 10,
    }


def _tts_config(hidden: int, layers: int, heads: int) -> dict:
    head_dim = hidden // heads
    return {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        # Small window so that tests cross it; every second layer is global.
        "sliding_window": 64,
        "sliding_window_pattern": 2,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": float(head_dim),
        "rope_global_base_freq": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "latent_size": 16,
        "num_quantizers": 31,
        "codebook_size": 1024,
        "num_delay_speech_tokens": 2,
        "num_iterations": 8,
        "guidance_scale": 0.2,
        "top_p": 0.95,
        "noise_scale": 0.001,
        "exponent": 3.0,
        "disable_eos_prediction": True,
        "use_gated_fusion_for_text_audio": True,
        "use_subword_flag_emb": True,
        "use_bos_eos_emb": True,
        "use_audio_prompt_frozen_projection": True,
        "audio_prompt_duration": 3.0,
        "character_encoder": {
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": head_dim,
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": float(head_dim),
            "attn_logit_softcapping": 50.0,
            "rope_base": 10000.0,
            "char_vocab_size": 257,
        },
        "mog_head": {
            "intermediate_size": 2 * hidden,
            "low_rank": 8,
            "min_log_std": -4.0,
            "num_layers": 2,
            "num_predictions": 64,
            "eps": 1e-6,
        },
    }


_CODEC_CONFIG = {
    "sample_rate": 22050,
    "base_channels": 8,
    "channel_multipliers": [1, 2, 4],
    "downsample_rates": [7, 7, 9],
    "blocks_per_stage": 1,
    "block_kernel_size": 7,
    "latent_dim": 16,
    "n_fft": 16,
    "hop_length": 4,
    "num_quantizers": 31,
    "codebook_size": 1024,
}


def _voicechat_config(text: dict, audio: dict, tts: dict) -> dict:
    return {
        "model_type": "nemotron_voicechat",
        "architectures": ["NemotronVoiceChatForConditionalGeneration"],
        "text_config": text,
        "audio_config": audio,
        "tts_config": tts,
        "codec_config": copy.deepcopy(_CODEC_CONFIG),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 12,
        "silence_token_id": 11,
        "rnnt_blank_id": RNNT_VOCAB_SIZE_TINY,
        "input_sample_rate": 16000,
        "output_sample_rate": 22050,
        "frame_duration": 0.08,
        "function_channel_weight": 2.0,
        "speaker": "Aria",
        # Filled in by the fixture factory from the SentencePiece model it trains.
        "rnnt_vocabulary": [],
    }


CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": _voicechat_config(
        _text_config(64, "M-M*-", heads=4, kv_heads=2),
        _audio_config(32, layers=2, heads=2, output_dim=64),
        _tts_config(64, layers=2, heads=4),
    ),
    "small": _voicechat_config(
        _text_config(256, _REAL_PATTERN_PREFIX[:14], heads=8, kv_heads=2),
        _audio_config(64, layers=4, heads=4, output_dim=256),
        _tts_config(128, layers=6, heads=4),
    ),
}


def _medium() -> dict[str, Any]:
    """Widths and depths in roughly the released checkpoint's ratios (LLM widest and
    deepest, then TTS, then encoder), every structural knob as in ``small``."""
    config = _voicechat_config(
        _text_config(768, (_REAL_PATTERN_PREFIX * 2)[:28], heads=12, kv_heads=4),
        _audio_config(256, layers=8, heads=4, output_dim=768),
        _tts_config(512, layers=12, heads=8),
    )
    config["codec_config"]["base_channels"] = 32
    return config


CONFIGS["medium"] = _medium()


def _full() -> dict[str, Any]:
    """The released 11B's shapes (issue 32): every width, depth, head and vocabulary size."""
    config = _voicechat_config(
        _text_config(4480, RELEASED_PATTERN, heads=40, kv_heads=8, head_dim=128,
                     mamba_heads=128, mamba_head_dim=80, ssm_state=128, groups=8,
                     vocab=131_072, intermediate=15_680),
        _audio_config(1024, layers=24, heads=8, output_dim=4480),
        _tts_config(1152, layers=28, heads=16),
    )
    audio = config["audio_config"]
    audio["encoder"]["subsampling_conv_channels"] = 256
    audio["decoder"].update(pred_hidden=640, vocab_size=1024)
    audio["joint"].update(joint_hidden=640, pred_hidden=640, num_classes=1024)
    config["rnnt_blank_id"] = 1024
    tts = config["tts_config"]
    tts.update(head_dim=72, intermediate_size=4608, latent_size=512, sliding_window=7500,
               sliding_window_pattern=6, query_pre_attn_scalar=256.0)
    tts["character_encoder"].update(head_dim=72, intermediate_size=4608,
                                    query_pre_attn_scalar=256.0)
    tts["mog_head"].update(intermediate_size=4608, num_predictions=1024, low_rank=64,
                           num_layers=3)
    config["codec_config"].update(base_channels=384, blocks_per_stage=3, latent_dim=512)
    return config


CONFIGS["full"] = _full()


def fixture_config(size: str) -> dict[str, Any]:
    """A fresh copy of the config.json dict for fixture ``size``."""
    if size not in CONFIGS:
        raise ValueError(f"size must be one of {sorted(CONFIGS)}, got {size!r}")
    return copy.deepcopy(CONFIGS[size])
