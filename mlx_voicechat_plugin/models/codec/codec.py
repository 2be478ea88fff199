"""The VoiceChat speech codec.

STFT -> ConvNeXt encoder -> probabilistic RVQ -> ConvNeXt decoder -> iSTFT.

22.05 kHz audio, one code frame per ``samples_per_frame`` samples (1764, i.e.
12.5 Hz), ``num_quantizers`` residual codebooks. Every ConvNeXt block pads
causally, and the up/down-sampling convolutions have ``stride == kernel``, so
the decoder is causal at frame level; :meth:`Codec.decode_step` streams it
with cached left context (see ``codec_stream`` for the iSTFT part), any
number of streams at once (:meth:`Codec.decode_streams`).

Tensors are channels-last (``[B, T, C]``) inside the networks.
"""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...config import CodecConfig
from .codec_rvq import ProbabilisticRVQ
from .codec_stream import CodecRows, CodecState, SpectralSynthesis
from ..rows import take_rows
from ..fast_forms import fast_ops_expand, mean_var_norm
from ..weight_layout import channels_last


# Hidden width of a ConvNeXt block's pointwise MLP, in multiples of its channels.
CONVNEXT_EXPANSION = 4


class ChannelNorm(nn.Module):
    """LayerNorm over the channel axis.

    Written out (rather than ``mx.fast.layer_norm``) so that encoder latents,
    and hence RVQ codes, match the reference to the last bit.
    """

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.bias = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        if fast_ops_expand():  # the same bits, one kernel fewer (fast_forms)
            return mean_var_norm(x, self.weight, self.bias, self.eps)
        mean = mx.mean(x, axis=-1, keepdims=True)
        var = mx.var(x, axis=-1, keepdims=True)
        return (x - mean) * mx.rsqrt(var + self.eps) * self.weight + self.bias


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv, norm, pointwise MLP (GELU), residual."""

    def __init__(self, dims: int, kernel_size: int):
        super().__init__()
        self.context = kernel_size - 1
        self.dwconv = nn.Conv1d(dims, dims, kernel_size, groups=dims)
        self.norm = ChannelNorm(dims)
        self.pwconv1 = nn.Conv1d(dims, CONVNEXT_EXPANSION * dims, 1)
        self.pwconv2 = nn.Conv1d(CONVNEXT_EXPANSION * dims, dims, 1)

    def __call__(self, x: mx.array, left: mx.array | None = None) -> mx.array:
        """``left``: the ``kernel_size - 1`` preceding inputs (zeros if ``None``)."""
        padded = (mx.pad(x, [(0, 0), (self.context, 0), (0, 0)]) if left is None
                  else mx.concatenate([left.astype(x.dtype), x], axis=1))
        h = self.pwconv1(self.norm(self.dwconv(padded)))
        return x + self.pwconv2(nn.gelu(h))


class CodecEncoder(nn.Sequential):
    """STFT channels -> latents, downsampling by each of ``downsample_rates``."""

    def __init__(self, config: CodecConfig):
        widths = config.stage_channels
        if len(widths) != len(config.downsample_rates):
            raise ValueError("channel_multipliers and downsample_rates differ in length")
        targets = widths[1:] + [config.latent_dim]
        layers: list[nn.Module] = [
            nn.Conv1d(2 * config.stft_bins, widths[0], 1, bias=False)
        ]
        for width, target, rate in zip(widths, targets, config.downsample_rates):
            layers += [
                ConvNeXtBlock(width, config.block_kernel_size)
                for _ in range(config.blocks_per_stage)
            ]
            layers.append(nn.Conv1d(width, target, rate, stride=rate, bias=False))
        super().__init__(*layers)


class CodecDecoder(nn.Module):
    """Latents -> STFT channels, upsampling in the reverse order of the encoder."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        widths = config.stage_channels[::-1]
        sources = [config.latent_dim] + widths[:-1]
        layers: list[nn.Module] = []
        for source, width, rate in zip(sources, widths, config.downsample_rates[::-1]):
            layers.append(
                nn.ConvTranspose1d(source, width, rate, stride=rate, bias=False)
            )
            layers += [
                ConvNeXtBlock(width, config.block_kernel_size)
                for _ in range(config.blocks_per_stage)
            ]
        layers.append(nn.Conv1d(widths[-1], 2 * config.stft_bins, 1, bias=False))
        self.layers = layers

    def __call__(
        self, x: mx.array, contexts: list[mx.array] | None = None
    ) -> mx.array:
        """``contexts`` (one per block) is read and advanced in place when given."""
        index = 0
        for layer in self.layers:
            if contexts is None or not isinstance(layer, ConvNeXtBlock):
                x = layer(x)
                continue
            left = contexts[index]
            window = mx.concatenate([left.astype(x.dtype), x], axis=1)
            contexts[index] = window[:, -layer.context :]
            x = layer(x, left)
            index += 1
        return x


class Codec(nn.Module):
    """Waveform <-> ``[B, Q, T]`` codes; streamed decode equals offline decode."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.encoder = CodecEncoder(config)
        self.decoder = CodecDecoder(config)
        self.prvq = ProbabilisticRVQ(config)
        self._synthesis = SpectralSynthesis(config.n_fft, config.hop_length)
        self._compiled_step = mx.compile(self._stream_step)  # traced at its first call

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    @property
    def stream_lag(self) -> int:
        """Samples ``decode_step`` holds back until the next chunk (or ``flush``)."""
        return self._synthesis.pad_left

    # --- encode -----------------------------------------------------------

    def _spectrum(self, waveform: mx.array) -> mx.array:
        """``[B, S]`` -> STFT features ``[B, F, 2 * bins]`` (real parts, then imaginary)."""
        n_fft, hop = self.config.n_fft, self.config.hop_length
        pad_left = (n_fft - hop) // 2
        # The rest of n_fft - hop at the back, and at least one whole frame.
        pad_right = max(n_fft - hop - pad_left, n_fft - pad_left - waveform.shape[1])
        padded = mx.pad(waveform.astype(mx.float32), [(0, 0), (pad_left, pad_right)])
        count = 1 + (padded.shape[1] - n_fft) // hop
        index = mx.arange(count)[:, None] * hop + mx.arange(n_fft)[None, :]
        spectrum = mx.fft.rfft(padded[:, index] * self._synthesis.window, axis=-1)
        return mx.concatenate([spectrum.real, spectrum.imag], axis=-1)

    def encode(self, waveform: mx.array) -> mx.array:
        """Mono ``[B, 1, S]`` or ``[B, S]`` audio -> ``[B, Q, S // samples_per_frame]``."""
        if waveform.ndim == 3:
            if waveform.shape[1] != 1:
                raise ValueError(f"codec input must be mono, got shape {waveform.shape}")
            waveform = waveform[:, 0]
        if waveform.ndim != 2 or waveform.shape[-1] == 0:
            raise ValueError(f"waveform must be [B, S] with S > 0, got {waveform.shape}")
        return self.prvq.encode(self.encoder(self._spectrum(waveform)))

    # --- decode -----------------------------------------------------------

    def decode(self, codes: mx.array) -> mx.array:
        """``[B, Q, T]`` codes -> ``[B, 1, T * samples_per_frame]`` float32 waveform."""
        features = self.decoder(self.prvq.decode(codes))
        return self._synthesis.offline(features)[:, None, :]

    def make_state(self, batch: int = 1) -> CodecState:
        """A fresh decode stream for ``batch`` parallel utterances."""
        contexts = [
            mx.zeros((batch, block.context, block.dwconv.weight.shape[0]))
            for block in self.decoder.layers if isinstance(block, ConvNeXtBlock)
        ]
        frames, weights = self._synthesis.initial_state(batch)
        return CodecState(contexts, frames, weights, skip=self._synthesis.pad_left)

    def decode_step(
        self, codes: mx.array, state: CodecState, evaluate: bool = True
    ) -> mx.array:
        """Decode ``[B, Q, T_new]`` new codes of a stream into ``[B, 1, n]`` samples.

        The concatenation of all outputs plus :meth:`flush` equals
        ``decode(all codes)`` sample for sample. The last :attr:`stream_lag`
        samples of each chunk depend on the next chunk's first spectrum, so
        they come out one call later: the first call returns
        ``T_new * samples_per_frame - stream_lag`` samples, later calls
        ``T_new * samples_per_frame``, and ``flush`` the final ``stream_lag``.
        The output and the state come back evaluated; with ``evaluate=False``
        the caller evaluates both (``state.state``) with the rest of its work.
        """
        state.check_open()
        if codes.shape[-1] == 0:
            return mx.zeros((codes.shape[0], 1, 0), dtype=mx.float32)
        start = self.prvq.zero_start(codes.shape[0], codes.shape[2])
        samples, state.frames, state.weights, *contexts = self._compiled_step(
            codes, start, state.frames, state.weights, *state.block_context
        )
        state.block_context = list(contexts)
        waveform = self._synthesis.trim(samples, state)[:, None, :]
        # Evaluate the carried state with the output, or every step's graph
        # would hang off the previous one for the life of the stream.
        if evaluate:
            mx.eval(waveform, *state.state)
        return waveform

    def decode_streams(self, codes: mx.array, streams: CodecRows) -> list[tuple[mx.array, int]]:
        """:meth:`decode_step` of many one-row streams held as one, lazily (``evaluate=False``).

        Row ``b`` of ``codes`` (``[B, Q, T_new]``) continues row ``b`` of
        ``streams``. Each group of rows in the same phase decodes as one batch
        (every decoder op is row-independent) and stays stacked
        (:class:`CodecRows`; groups whose phases have met are stacked first);
        when one group holds every row, in order, ``codes`` is its batch as it
        is. Returns each row's waveform as ``(its group's [G, 1, n] waveform,
        its row there)``, equal to that stream's own ``decode_step``, and so is
        each row's state; the caller evaluates those arrays with
        ``streams.state``.
        """
        streams.regroup()
        out: dict[int, tuple[mx.array, int]] = {}
        for members, state in streams.groups:
            waveform = self.decode_step(take_rows(codes, members), state, evaluate=False)
            out.update((b, (waveform, j)) for j, b in enumerate(members))
        return [out[b] for b in range(codes.shape[0])]

    def _stream_step(
        self, codes: mx.array, start: mx.array, frames: mx.array, weights: mx.array,
        *contexts: mx.array
    ) -> tuple[mx.array, ...]:
        """Pure decode step (compiled: its shapes repeat every frame)."""
        context_list = list(contexts)
        features = self.decoder(self.prvq.decode(codes, start), context_list)
        samples, frames, weights = self._synthesis.advance(features, frames, weights)
        return (samples, frames, weights, *context_list)

    def flush(self, state: CodecState) -> mx.array:
        """End a stream: return its last :attr:`stream_lag` samples ``[B, 1, n]``."""
        state.check_open()
        state.closed = True
        return self._synthesis.flush(state)[:, None, :]

    # --- weights ----------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """NeMo/PyTorch codec weights (keys relative to the codec) -> this module's layout.

        Conv1d ``[out, in, k]`` -> ``[out, k, in]``; ConvTranspose1d
        ``[in, out, k]`` -> ``[out, k, in]``; ``prvq._variance_list`` ->
        ``prvq.variance_list``. Layout is decided by comparing each tensor with
        the module's own parameter shape, not by key pattern, so sanitizing
        already-converted weights (a re-saved MLX checkpoint, or a second
        pass by the parent model) is a no-op. Both layouts can only share a
        shape when a kernel size equals a channel count (in == k for Conv1d,
        in == out == k for ConvTranspose1d), which no codec layer has.
        Keys the module does not know pass through for strict loading to flag.
        """
        own = dict(tree_flatten(self.parameters()))
        transposed = {
            f"decoder.layers.{i}.weight"
            for i, layer in enumerate(self.decoder.layers)
            if isinstance(layer, nn.ConvTranspose1d)
        }
        result = {}
        for key, value in weights.items():
            key = key.replace("prvq._variance_list.", "prvq.variance_list.")
            target = own.get(key)
            if target is not None and value.ndim == 3:
                value = channels_last(key, value, target.shape, key in transposed)
            result[key] = value
        return result
