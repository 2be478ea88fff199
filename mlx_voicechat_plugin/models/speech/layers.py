"""Small blocks shared by the EAR-TTS networks: Gemma-style norm and gated MLP."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..fused import gated_mlp


class OffsetRMSNorm(nn.Module):
    """RMSNorm with scale ``1 + weight``, computed in float32, returned in input dtype."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        scale = 1.0 + self.weight.astype(mx.float32)
        y = mx.fast.rms_norm(x.astype(mx.float32), scale, self.eps)
        return y.astype(x.dtype)


class GatedMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))`` without biases."""

    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden_dims, bias=False)
        self.up_proj = nn.Linear(dims, hidden_dims, bias=False)
        self.down_proj = nn.Linear(hidden_dims, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return gated_mlp(self, x)  # gate and up as one product once fused


class GatedFusion(nn.Module):
    """``norm(sigmoid(r) * (g * A(audio / Q) + (1 - g) * T(text)))``, ``g = sigmoid(gate)``."""

    def __init__(self, dims: int, num_codebooks: int, eps: float):
        super().__init__()
        self.num_codebooks = num_codebooks
        self.audio_proj = nn.Linear(dims, dims)
        self.text_proj = nn.Linear(dims, dims)
        self.gate = mx.zeros((dims,))
        self.residual_scale = mx.array(0.5)
        self.final_norm = OffsetRMSNorm(dims, eps)

    def __call__(self, audio: mx.array, text: mx.array) -> mx.array:
        audio = self.audio_proj(audio / self.num_codebooks)
        text = self.text_proj(text)
        gate = mx.sigmoid(self.gate).astype(audio.dtype)
        scale = mx.sigmoid(self.residual_scale).astype(audio.dtype)
        return self.final_norm(scale * (gate * audio + (1.0 - gate) * text))
