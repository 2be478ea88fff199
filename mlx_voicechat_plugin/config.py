"""Configuration for Nemotron VoiceChat checkpoints (``model_type: nemotron_voicechat``).

Every network reads its sizes from here; the runtime reads sentinel ids and
timing constants from :class:`ModelConfig`. The on-disk ``config.json`` is the
one written by the mlx-community conversion, so field names follow it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mlx_audio.stt.models.nemotron_asr.config import (
    ConformerArgs,
    JointArgs,
    PredictArgs,
    PreprocessArgs,
)
from mlx_vlm.models.nemotron_h.config import ModelConfig as TextConfig

from .checkpoint import MODEL_TYPE

SUPPORTED_SPEAKERS = ("Aria",)

T = TypeVar("T")


def _known_fields(cls: type[T], values: dict | None) -> T:
    """Build dataclass ``cls`` from the keys of ``values`` it declares."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in (values or {}).items() if k in names})


@dataclass
class AudioConfig:
    """Perception (mel + FastConformer + projection) and the RNNT branch."""

    preprocessor: PreprocessArgs = field(default_factory=PreprocessArgs)
    encoder: ConformerArgs = field(
        default_factory=lambda: ConformerArgs(att_context_size=[[70, 0]])
    )
    decoder: PredictArgs = field(default_factory=lambda: PredictArgs(vocab_size=1024))
    joint: JointArgs = field(default_factory=lambda: JointArgs(num_classes=1024))
    output_dim: int = 4480
    max_symbols: int = 10

    @classmethod
    def from_dict(cls, values: dict | None) -> "AudioConfig":
        values = dict(values or {})
        encoder = dict(values.get("encoder", {}))
        context = encoder.get("att_context_size")
        # A single [left, right] pair is stored flat in some exports.
        if context and isinstance(context[0], int):
            encoder["att_context_size"] = [list(context)]
        return cls(
            preprocessor=_known_fields(PreprocessArgs, values.get("preprocessor")),
            encoder=_known_fields(ConformerArgs, encoder),
            decoder=_known_fields(PredictArgs, values.get("decoder")),
            joint=_known_fields(JointArgs, values.get("joint")),
            output_dim=values.get("output_dim", 4480),
            max_symbols=values.get("max_symbols", 10),
        )

    @property
    def left_context(self) -> int:
        return int(self.encoder.att_context_size[0][0])


@dataclass
class CharacterEncoderConfig:
    """The T5Gemma character encoder inside the char-aware subword encoder."""

    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float = 50.0
    rope_base: float = 10_000.0
    char_vocab_size: int = 257
    # Size of the subword flag tables; fixed by the source tokenizer (2**17).
    subword_vocab_size: int = 131_072

    @classmethod
    def from_dict(cls, values: dict | None) -> "CharacterEncoderConfig":
        return _known_fields(cls, values)


@dataclass
class MoGConfig:
    """Mixture-of-Gaussians depth head."""

    intermediate_size: int = 4608
    low_rank: int = 64
    min_log_std: float = -4.0
    num_layers: int = 3
    num_predictions: int = 1024
    eps: float = 1e-6

    @classmethod
    def from_dict(cls, values: dict | None) -> "MoGConfig":
        return _known_fields(cls, values)


@dataclass
class TTSConfig:
    """EAR-TTS: Gemma-3 backbone, fusion, MoG head and RVQ sampling settings."""

    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    sliding_window: int = 7500
    sliding_window_pattern: int = 6
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0
    rope_global_base_freq: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    latent_size: int = 512
    num_quantizers: int = 31
    codebook_size: int = 1024
    num_delay_speech_tokens: int = 2
    num_iterations: int = 8
    guidance_scale: float = 0.2
    top_p: float = 0.95
    noise_scale: float = 0.001
    exponent: float = 3.0
    disable_eos_prediction: bool = True
    use_gated_fusion_for_text_audio: bool = True
    use_subword_flag_emb: bool = True
    use_bos_eos_emb: bool = True
    use_audio_prompt_frozen_projection: bool = True
    audio_prompt_duration: float = 3.0
    # Frames of the stored speaker prompt latents (3 s at 12.5 Hz, minus one).
    prompt_frames: int = 37
    character_encoder: CharacterEncoderConfig = field(
        default_factory=CharacterEncoderConfig
    )
    mog_head: MoGConfig = field(default_factory=MoGConfig)

    @classmethod
    def from_dict(cls, values: dict | None) -> "TTSConfig":
        values = dict(values or {})
        values["character_encoder"] = CharacterEncoderConfig.from_dict(
            values.get("character_encoder")
        )
        values["mog_head"] = MoGConfig.from_dict(values.get("mog_head"))
        return _known_fields(cls, values)

    @property
    def mask_code(self) -> int:
        """The id one past the codebook: "not generated yet" in the depth loop."""
        return self.codebook_size


@dataclass
class CodecConfig:
    """The 22.05 kHz ConvNeXt / probabilistic-RVQ / iSTFT codec."""

    sample_rate: int = 22_050
    base_channels: int = 384
    channel_multipliers: tuple[int, ...] = (1, 2, 4)
    downsample_rates: tuple[int, ...] = (7, 7, 9)
    blocks_per_stage: int = 3
    block_kernel_size: int = 7
    latent_dim: int = 512
    n_fft: int = 16
    hop_length: int = 4
    num_quantizers: int = 31
    codebook_size: int = 1024

    @classmethod
    def from_dict(cls, values: dict | None) -> "CodecConfig":
        values = dict(values or {})
        for name in ("channel_multipliers", "downsample_rates"):
            if name in values:
                values[name] = tuple(values[name])
        return _known_fields(cls, values)

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per code frame (1764 for the released codec)."""
        ratio = self.hop_length
        for rate in self.downsample_rates:
            ratio *= rate
        return ratio

    @property
    def stft_bins(self) -> int:
        return self.n_fft // 2 + 1

    @property
    def stage_channels(self) -> list[int]:
        return [self.base_channels * m for m in self.channel_multipliers]


@dataclass
class ModelConfig:
    text_config: TextConfig
    audio_config: AudioConfig = field(default_factory=AudioConfig)
    tts_config: TTSConfig = field(default_factory=TTSConfig)
    codec_config: CodecConfig = field(default_factory=CodecConfig)
    model_type: str = MODEL_TYPE
    # Sentinel token ids of the Nemotron tokenizer; named once, here.
    bos_token_id: int = 1
    eos_token_id: int = 2
    silence_token_id: int = 11
    pad_token_id: int = 12
    rnnt_blank_id: int = 1024
    input_sample_rate: int = 16_000
    output_sample_rate: int = 22_050
    frame_duration: float = 0.08
    function_channel_weight: float = 2.0
    default_system_prompt: str = ""
    rnnt_vocabulary: list[str] = field(default_factory=list)
    speaker: str = "Aria"
    quantization: dict[str, Any] | None = None
    quantization_config: dict[str, Any] | None = None
    # The precision profile a conversion wrote (``profiles.Profile.record``).
    voicechat_profile: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        text = values.get("text_config")
        if not text:
            raise ValueError("config.json: nemotron_voicechat requires text_config")
        if not isinstance(text, TextConfig):
            text = TextConfig.from_dict(text)
        sub = {
            "text_config": text,
            "audio_config": AudioConfig.from_dict(values.get("audio_config")),
            "tts_config": TTSConfig.from_dict(values.get("tts_config")),
            "codec_config": CodecConfig.from_dict(values.get("codec_config")),
        }
        names = {f.name for f in dataclasses.fields(cls)}
        rest = {k: v for k, v in values.items() if k in names and k not in sub}
        config = cls(**sub, **rest)
        config.validate()
        return config

    def validate(self) -> None:
        if self.model_type != MODEL_TYPE:
            raise ValueError(
                f"config.json: model_type must be {MODEL_TYPE!r}, got {self.model_type!r}"
            )
        if self.voicechat_profile is not None and not isinstance(self.voicechat_profile, dict):
            raise ValueError("config.json: voicechat_profile must be an object, got "
                             f"{type(self.voicechat_profile).__name__}")
        if self.speaker not in SUPPORTED_SPEAKERS:
            raise ValueError(
                f"config.json: speaker {self.speaker!r} is not supported; this "
                f"checkpoint format ships prompt latents for {', '.join(SUPPORTED_SPEAKERS)} only"
            )

    @property
    def memory_first(self) -> bool:
        """Whether the checkpoint's profile asks to be loaded without float32 copies."""
        return bool((self.voicechat_profile or {}).get("memory_first", False))

    @property
    def frame_samples(self) -> int:
        """Input samples per 80 ms frame (1280 at 16 kHz)."""
        return round(self.input_sample_rate * self.frame_duration)

    @property
    def special_text_ids(self) -> frozenset[int]:
        """Ids that never reach user-visible text."""
        return frozenset(
            {self.pad_token_id, self.silence_token_id, self.bos_token_id, self.eos_token_id}
        )
