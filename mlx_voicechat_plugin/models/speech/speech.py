"""The speech side of the checkpoint (prefix ``tts_model``): codec, EAR-TTS and buffers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...config import CodecConfig, TTSConfig
from .ear_tts import EarTTS
from ..weight_layout import sanitize_under


_CODEC_PREFIX = "audio_codec."
# Checkpoint name -> module attribute for buffers stored under a private name.
_RENAMES = {"_control_codes": "control_codes"}


class SpeechDecoder(nn.Module):
    """Container matching the checkpoint: ``audio_codec``, ``tts_model`` and buffers.

    ``control_codes`` are the codec ids EAR-TTS uses as control symbols; they are
    replaced by ``codec_silence_tokens`` before decoding.
    """

    def __init__(self, tts_config: TTSConfig, codec_config: CodecConfig):
        super().__init__()
        from ..codec.codec import Codec  # written alongside; imported late on purpose


        self.audio_codec = Codec(codec_config)
        self.tts_model = EarTTS(tts_config)
        self.control_codes = mx.zeros((3,), dtype=mx.int32)
        # Stored speaker prompts, one [1, prompt_frames, hidden] latent per voice.
        self.audio_prompt_latents = {
            "Aria": mx.zeros((1, tts_config.prompt_frames, tts_config.hidden_size))}
        self.codec_silence_tokens = mx.zeros((tts_config.num_quantizers,), dtype=mx.int32)

    def replace_control_codes(self, codes: mx.array) -> mx.array:
        """Control codes become the per-codebook silence code. ``codes`` is ``(..., Q)``."""
        control = self.control_codes.astype(codes.dtype)
        is_control = (codes[..., None] == control).any(axis=-1)
        return mx.where(is_control, self.codec_silence_tokens.astype(codes.dtype), codes)

    def warmup_inputs(self, pad_token_id: int) -> tuple[mx.array, ...]:
        """The EAR-TTS warm-up: the Aria prompt latents over codec-encoded silence.

        Returns ``(codes, subword_ids, subword_mask, audio_mask, latents)`` for one
        stream. The frame after the prompt and the first prompt frame carry the
        mask code (one past the codebook); text is ``pad_token_id`` with the last
        two positions marked valid, and only the last position is audio.
        """
        frames = self.audio_prompt_latents["Aria"].shape[1]
        samples = (frames + 1) * self.audio_codec.samples_per_frame
        codes = self.audio_codec.encode(mx.zeros((1, 1, samples), dtype=mx.float32))
        codes = codes.transpose(0, 2, 1)[:, :frames].astype(mx.int32)  # (1, frames, Q)
        codes[:, [0, frames - 1]] = self.tts_model.config.mask_code
        subword_ids = mx.full((1, frames), pad_token_id, dtype=mx.int32)
        positions = mx.arange(frames)[None]
        subword_mask = positions >= frames - 2
        audio_mask = positions >= frames - 1
        return codes, subword_ids, subword_mask, audio_mask, self.audio_prompt_latents["Aria"][:1]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Rename private buffers; the codec converts its own ``audio_codec.*`` tensors."""
        weights = sanitize_under(_CODEC_PREFIX, weights, self.audio_codec.sanitize)
        return {_RENAMES.get(key, key): value for key, value in weights.items()}
