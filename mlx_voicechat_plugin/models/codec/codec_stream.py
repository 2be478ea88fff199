"""Codec waveform synthesis: the inverse STFT, offline and streamed.

The decoder predicts one spectrum per ``hop_length`` samples. Each spectrum is
inverse-FFT'd, clipped to the window envelope, windowed, overlap-added and
divided by the summed squared window of the frames that exist (``center=False``).
The result is trimmed by ``pad_left = (n_fft - hop) // 2`` at the front and
the rest of the padding at the back, so ``F`` spectra give exactly ``F * hop`` samples.

Overlap-add is done in blocks of ``hop`` samples: block ``k`` is the sum over
``r`` of the ``r``-th hop-long piece of frame ``k - r``. Offline, the missing
frames at both ends are zeros; streaming keeps the last ``n_fft / hop - 1``
frames as left context. Both run the same ``_overlap_add`` on the same operands
in the same order, so their samples agree bit for bit.

Streaming lag: OLA sample ``j`` is final once frame ``j // hop`` has arrived, so
after ``F`` frames the samples ``< F * hop`` of the OLA are final, i.e. output
samples ``< F * hop - pad_left``. The last ``pad_left`` samples of every chunk
(6 for the released codec) depend on the next chunk's first spectrum; they are
emitted with the next chunk, and by :meth:`SpectralSynthesis.flush` at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_audio.dsp import hanning

from ..rows import RowGroups, keep_rows, own_row, stack_rows

# The decoder's magnitude head saturates softly at this value (fixed by the
# trained codec, not a config field).
MAX_MAGNITUDE = 100.0
# Floor of the window normalisation, as in torch.istft / mlx_audio.dsp.
_NORM_FLOOR = 1e-10


@dataclass
class CodecState:
    """Decoder state of ``B`` streams in the same phase; build one with ``Codec.make_state``.

    ``block_context``: the last ``kernel_size - 1`` inputs of each decoder
    ConvNeXt block, ``[B, K - 1, C]`` (zeros before the stream starts).
    ``frames`` / ``weights``: the last ``n_fft / hop - 1`` windowed frames
    ``[B, R - 1, n_fft]`` and their squared-window weights ``[R - 1, n_fft]``
    (zero for frames before the stream start; the same for every row).
    ``skip``: output samples still to drop at the front (``pad_left`` at start).
    ``spectra``: spectra consumed so far, counted up to ``R - 1``, after
    which ``weights`` no longer change.

    mlx-lm's cache convention: ``state`` (the arrays) and ``meta_state``
    (``skip``, ``spectra``, ``closed``), and :meth:`from_state` to rebuild one.
    Streams whose ``meta_state`` is equal are in the same phase (the same
    weights and front trim): :meth:`merge` stacks their rows into one state
    for one decode step, and :meth:`extract` takes one row back out.
    """

    block_context: list[mx.array]
    frames: mx.array
    weights: mx.array
    skip: int
    spectra: int = 0
    closed: bool = False

    @property
    def state(self) -> list[mx.array]:
        return [*self.block_context, self.frames, self.weights]

    @property
    def meta_state(self) -> tuple[int, int, bool]:
        return (self.skip, self.spectra, self.closed)

    def key(self) -> tuple[int, int, bool]:
        """What streams must share to stack: their phase (:attr:`meta_state`)."""
        return self.meta_state

    @classmethod
    def from_state(cls, state: list[mx.array], meta_state: tuple[int, int, bool]) -> "CodecState":
        *contexts, frames, weights = state
        return cls(list(contexts), frames, weights, *meta_state)

    @property
    def batch_size(self) -> int:
        return self.frames.shape[0]

    @property
    def row_nbytes(self) -> int:
        """The bytes of one row's own state (its slices and the shared ``weights``)."""
        stacked = sum(c.nbytes for c in self.block_context) + self.frames.nbytes
        return stacked // self.batch_size + self.weights.nbytes

    @classmethod
    def merge(cls, rows: list["CodecState"]) -> "CodecState":
        """One state of the rows' streams, stacked in order (one row: that row itself)."""
        if len(rows) == 1:
            return rows[0]
        meta = rows[0].meta_state
        if any(r.meta_state != meta for r in rows):
            raise ValueError("codec streams merge only in the same phase (equal meta_state)")
        *contexts, frames = [stack_rows(parts)
                             for parts in zip(*([*r.block_context, r.frames] for r in rows))]
        return cls(contexts, frames, rows[0].weights, *meta)

    def extract(self, index: int, copy: bool = True) -> "CodecState":
        """Row ``index`` as a one-row state (a one-row state: itself; ``copy=False``:
        slices, for a row stacked again)."""
        if self.batch_size == 1:
            return self
        return CodecState([own_row(c, index, copy) for c in self.block_context],
                          own_row(self.frames, index, copy), self.weights, *self.meta_state)

    def filter(self, keep: list[int]) -> "CodecState":
        """Rows ``keep`` (ascending) as one state, one gather per array (copies)."""
        return CodecState([keep_rows(c, keep) for c in self.block_context],
                          keep_rows(self.frames, keep), self.weights, *self.meta_state)

    def check_open(self) -> None:
        if self.closed:
            raise ValueError("codec stream was flushed; start a new one with make_state()")


class CodecRows(RowGroups):
    """Decoder states of ``B`` streams, kept stacked between steps, in any phases
    (:class:`~.rows.RowGroups`): streams in the same phase are one
    :class:`CodecState`; a stream that started later is a group of its own until
    its phase meets the others' (``Codec.decode_streams`` regroups first). One
    stream is its own state.
    """

    kind = CodecState


class SpectralSynthesis:
    """Spectra predicted by the decoder -> waveform, offline or one chunk at a time."""

    def __init__(self, n_fft: int, hop_length: int):
        if n_fft % hop_length:
            raise ValueError(
                f"n_fft ({n_fft}) must be a multiple of hop_length ({hop_length})"
            )
        self.n_fft = n_fft
        self.hop = hop_length
        self.overlap = n_fft // hop_length  # frames covering one sample
        self.bins = n_fft // 2 + 1
        self.pad_left = (n_fft - hop_length) // 2
        self.window = hanning(n_fft, periodic=True).astype(mx.float32)
        self.window_sq = self.window * self.window
        # rFFT DC and Nyquist bins are real: their phase output is ignored.
        index = mx.arange(self.bins)
        self._complex_bins = (index > 0) & (index < self.bins - 1)
        # Constants of every frame: evaluated here, or each compiled frame would
        # recompute them (an unevaluated capture is traced with its producers).
        mx.eval(self.window, self.window_sq, self._complex_bins)

    def frames(self, features: mx.array) -> mx.array:
        """Decoder output ``[B, F, 2 * bins]`` -> windowed frames ``[B, F, n_fft]``."""
        logits = features[..., : self.bins]
        phase = features[..., self.bins :]
        magnitude = MAX_MAGNITUDE * mx.exp(
            -nn.softplus(math.log(MAX_MAGNITUDE) - logits)
        )
        real = magnitude * mx.cos(phase)
        imag = mx.where(self._complex_bins, magnitude * mx.sin(phase), 0.0)
        frames = mx.fft.irfft(real + 1j * imag, n=self.n_fft, axis=-1)
        frames = mx.clip(frames, -self.window, self.window)
        return frames * self.window

    def _overlap_add(self, frames: mx.array, weights: mx.array) -> mx.array:
        """OLA of every frame after the first ``overlap - 1`` (the left context).

        ``frames`` ``[B, N, n_fft]``, ``weights`` ``[N, n_fft]`` -> normalised
        samples ``[B, (N - overlap + 1) * hop]``.
        """
        blocks = frames.shape[1] - (self.overlap - 1)
        signal = norm = None
        for r in range(self.overlap):
            first = self.overlap - 1 - r
            cols = slice(r * self.hop, (r + 1) * self.hop)
            piece = frames[:, first : first + blocks, cols]
            weight = weights[first : first + blocks, cols]
            signal = piece if signal is None else signal + piece
            norm = weight if norm is None else norm + weight
        samples = signal / mx.maximum(norm, _NORM_FLOOR)
        return samples.reshape(frames.shape[0], blocks * self.hop)

    def _weights(self, count: int) -> mx.array:
        return mx.broadcast_to(self.window_sq, (count, self.n_fft))

    def offline(self, features: mx.array) -> mx.array:
        """Whole utterance: ``[B, F, 2 * bins]`` -> ``[B, F * hop]``."""
        frames = self.frames(features)
        batch, count, _ = frames.shape
        pad, no_weight = self.initial_state(batch)  # no frames past either end
        samples = self._overlap_add(
            mx.concatenate([pad, frames, pad], axis=1),
            mx.concatenate([no_weight, self._weights(count), no_weight], axis=0),
        )
        return samples[:, self.pad_left : self.pad_left + count * self.hop]

    def initial_state(self, batch: int) -> tuple[mx.array, mx.array]:
        """Left context of a fresh stream: no frames, zero weight."""
        edge = self.overlap - 1
        return (
            mx.zeros((batch, edge, self.n_fft), dtype=mx.float32),
            mx.zeros((edge, self.n_fft), dtype=mx.float32),
        )

    def advance(
        self, features: mx.array, frames: mx.array, weights: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Pure streaming step: ``F`` new spectra + left context -> (OLA samples, new context).

        The samples are the ``F * hop`` now final, before the front trim
        (:meth:`trim`); pure so the codec can compile it.
        """
        new = self.frames(features)
        count = new.shape[1]
        frames = mx.concatenate([frames.astype(new.dtype), new], axis=1)
        weights = mx.concatenate([weights, self._weights(count)], axis=0)
        samples = self._overlap_add(frames, weights)
        keep = frames.shape[1] - (self.overlap - 1)
        return samples, frames[:, keep:], weights[keep:]

    def trim(self, samples: mx.array, state: CodecState) -> mx.array:
        """Count the step's spectra and drop what the offline decode trims at the front."""
        state.spectra = min(state.spectra + samples.shape[1] // self.hop, self.overlap - 1)
        return _drop_front(samples, state)

    def flush(self, state: CodecState) -> mx.array:
        """End of stream: the last ``pad_left`` samples (no spectra follow)."""
        if not state.spectra:
            return mx.zeros((state.frames.shape[0], 0), dtype=mx.float32)
        pad, no_weight = self.initial_state(state.frames.shape[0])  # no frames follow
        frames = mx.concatenate([state.frames, pad], axis=1)
        weights = mx.concatenate([state.weights, no_weight], axis=0)
        tail = self._overlap_add(frames, weights)[:, : self.pad_left]
        return _drop_front(tail, state)


def _drop_front(samples: mx.array, state: CodecState) -> mx.array:
    """Drop the samples the offline decode trims at the front (``pad_left``)."""
    cut = min(state.skip, samples.shape[1])
    state.skip -= cut
    return samples[:, cut:]
