"""The speech side of the checkpoint (prefix ``tts_model``): codec, EAR-TTS and buffers."""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn

from ..config import CodecConfig, TTSConfig
from .ear_tts import EarTTS


_CODEC_PREFIX = "audio_codec."
# Checkpoint name -> module attribute for buffers stored under a private name.
_RENAMES = {"_control_codes": "control_codes"}


class PromptLatents(nn.Module):
    """Stored speaker prompts, one ``[1, prompt_frames, hidden]`` latent per voice."""

    def __init__(self, hidden_size: int, frames: int):
        super().__init__()
        self.Aria = mx.zeros((1, frames, hidden_size))


class SpeechDecoder(nn.Module):
    """Container matching the checkpoint: ``audio_codec``, ``tts_model`` and buffers.

    ``control_codes`` are the codec ids EAR-TTS uses as control symbols; they are
    replaced by ``codec_silence_tokens`` before decoding.
    """

    def __init__(self, tts_config: TTSConfig, codec_config: CodecConfig):
        super().__init__()
        from .codec import Codec  # written alongside; imported late on purpose

        self.audio_codec = Codec(codec_config)
        self.tts_model = EarTTS(tts_config)
        self.control_codes = mx.zeros((3,), dtype=mx.int32)
        self.audio_prompt_latents = PromptLatents(tts_config.hidden_size, tts_config.prompt_frames)
        self.codec_silence_tokens = mx.zeros((tts_config.num_quantizers,), dtype=mx.int32)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Rename private buffers; the codec converts its own ``audio_codec.*`` tensors."""
        out: dict[str, mx.array] = {}
        codec: dict[str, mx.array] = {}
        for key, value in weights.items():
            if key.startswith(_CODEC_PREFIX):
                codec[key[len(_CODEC_PREFIX) :]] = value
            else:
                out[_RENAMES.get(key, key)] = value
        for key, value in self.audio_codec.sanitize(codec).items():
            out[_CODEC_PREFIX + key] = value
        return out
