"""Streaming log-mel frames, many streams in one graph.

Each stream keeps a bounded host-side sample tail (numpy, trimmed without an
evaluation) and emits a centred mel frame once it trails the input edge by
``lookahead`` samples, as mlx-audio's ``StreamingLogMelSpectrogram`` does over
its ``log_mel_spectrogram_frames``.

The work splits where the data lives. On the host, per stream (cheap, its
samples are host data already): preemphasis, the centred STFT's edge padding,
framing and the analysis window. On the device, once for every stream whose
frames have the same shape (:func:`log_mel_many`; at steady state every stream
pushes one frame's worth, so one group): FFT, power, the mel filterbank and
the log. A pool step of ``N`` streams then costs the kernels of one.

Exactness: row by row the result is bit-identical to mlx-audio's
``log_mel_spectrogram_frames`` of that stream alone. The host part does the
same float32 operations element by element (a multiply and a subtract per
preemphasised sample, a multiply per windowed one; IEEE rounding is the same
in numpy and MLX), and the device part is row-wise: the FFT transforms each
frame on its own, and the filterbank matmul's output column for a frame does
not depend on the other columns (``tests/test_mel_stream.py`` checks both).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np
from mlx_audio.dsp import STR_TO_WINDOW_FN, hanning, mel_filters
from mlx_audio.stt.models.nemotron_asr.audio import PreprocessArgs

from .rows import take_row

def _constants(args: PreprocessArgs) -> tuple[np.ndarray, mx.array]:
    """The centre-padded analysis window (host) and the Slaney mel filterbank (device),
    made once per configuration."""
    return _made_constants(args.window, args.win_length, args.n_fft, args.sample_rate,
                           args.features)


@functools.lru_cache(maxsize=8)
def _made_constants(window_name: str, win_length: int, n_fft: int, sample_rate: int,
                    features: int) -> tuple[np.ndarray, mx.array]:
    """:func:`_constants` of one configuration: a pure function of it, cached (neither
    array is written by its readers)."""
    window = np.array(STR_TO_WINDOW_FN.get(window_name, hanning)(win_length), dtype=np.float32)
    if window.shape[0] < n_fft:  # centre-pad to n_fft (as torch.stft / NeMo)
        left = (n_fft - window.shape[0]) // 2
        window = np.pad(window, (left, n_fft - window.shape[0] - left))
    window.flags.writeable = False
    filters = mel_filters(sample_rate, n_fft, features,
                          norm="slaney", mel_scale="slaney").astype(mx.float32)
    mx.eval(filters)
    return window, filters


def host_frames(x: np.ndarray, args: PreprocessArgs, start: int, end: int) -> np.ndarray:
    """Windowed STFT frames ``[start, end)`` of float32 samples ``x``: ``(end - start, n_fft)``.

    The host half of mlx-audio's ``log_mel_spectrogram_frames``, the same
    float32 operations: preemphasis with the previous sample's state,
    the centred STFT's edge padding, zero padding to whole frames, the window.
    """
    hop, n_fft = args.hop_length, args.n_fft
    count = end - start
    sample_start = start * hop - n_fft // 2
    sample_end = (end - 1) * hop - n_fft // 2 + n_fft
    raw_start, raw_end = max(sample_start, 0), min(sample_end, x.shape[0])
    raw = x[raw_start:raw_end]
    if args.preemph and args.preemph > 0 and raw.shape[0] > 0:
        alpha = np.float32(args.preemph)
        if raw_start > 0:  # y[n] = x[n] - alpha * x[n - 1], x[n - 1] from before the range
            raw = raw - alpha * x[raw_start - 1 : raw_end - 1]
        else:
            raw = np.concatenate([raw[:1], raw[1:] - alpha * raw[:-1]])
    pieces = []
    for pad, edge in ((max(-sample_start, 0), "left"), (max(sample_end - x.shape[0], 0), "right")):
        if not pad:
            pieces.append(None)
        elif args.pad_mode == "reflect":
            pieces.append(raw[1 : pad + 1][::-1] if edge == "left" else raw[-(pad + 1) : -1][::-1])
        elif args.pad_mode == "constant":
            pieces.append(np.zeros((pad,), dtype=np.float32))
        else:
            raise ValueError(f"unsupported log-mel pad_mode {args.pad_mode!r}")
    segment = np.concatenate([p for p in (pieces[0], raw, pieces[1]) if p is not None])
    length = (count - 1) * hop + n_fft
    if segment.shape[0] < length:
        segment = np.pad(segment, (0, length - segment.shape[0]))
    frames = np.lib.stride_tricks.sliding_window_view(segment, n_fft)[::hop][:count]
    return frames * _constants(args)[0]


def _power(spectrum: mx.array) -> mx.array:
    return mx.square(mx.abs(spectrum))


def _log(mel: mx.array, guard: mx.array) -> mx.array:
    return mx.log(mel + guard)


# The elementwise chains each fuse into one kernel when compiling is on (the
# same operations, so the same bits: tests/test_mel_stream.py).
_power_c, _log_c = mx.compile(_power), mx.compile(_log)


def device_log_mel(frames: mx.array, args: PreprocessArgs) -> mx.array:
    """``(G, n, n_fft)`` windowed frames -> ``(G, n, features)`` log-mel, every frame at once:
    FFT, power, filterbank, log (four kernels compiled, seven not)."""
    groups, count, n_fft = frames.shape
    filters = _constants(args)[1]
    power = _power_c(mx.fft.rfft(frames.reshape(groups * count, n_fft)))
    mel = _log_c(filters @ power.T, mx.array(args.log_zero_guard_value, dtype=mx.float32))
    return mel.T.reshape(groups, count, -1)


class MelStream:
    """Centred log-mel frames as audio arrives, from a bounded host-side sample tail.

    A frame is emitted once its centre trails the input edge by ``lookahead``
    samples. :meth:`push` is one stream alone; :func:`log_mel_many` pushes many
    and runs their device work together.
    """

    def __init__(self, args: PreprocessArgs, lookahead: int):
        if args.pad_to > 0 or args.normalize in ("per_feature", "all_features"):
            raise ValueError("streaming log-mel needs preprocessor pad_to=0 and normalize='NA'")
        if lookahead < args.n_fft // 2:
            raise ValueError(f"lookahead must be >= n_fft // 2 = {args.n_fft // 2}, got {lookahead}")
        self.args = args
        self.lookahead = lookahead
        _constants(args)  # made here, once per configuration, not inside a frame (host syncs)
        # Samples before the next frame centre that the STFT and preemphasis read.
        self._lookbehind_frames = math.ceil((args.n_fft // 2 + 1) / args.hop_length)
        self._samples = np.zeros((0,), dtype=np.float32)
        self._start = 0  # stream index of ``_samples[0]``
        self._total = 0
        self._next_frame = 0

    def take(self, samples: np.ndarray) -> np.ndarray | None:
        """Mono samples in -> the windowed frames now complete (host, ``(n, n_fft)``),
        or ``None`` when none is."""
        hop = self.args.hop_length
        self._samples = np.concatenate([self._samples, samples.astype(np.float32, copy=False)])
        self._total += samples.shape[0]
        centre = self._total - self.lookahead
        end = centre // hop + 1 if centre >= 0 else 0
        if end <= self._next_frame:
            return None
        first = self._start // hop
        frames = host_frames(self._samples, self.args, self._next_frame - first, end - first)
        self._next_frame = end
        keep = max(end - self._lookbehind_frames, 0) * hop
        if keep > self._start:
            self._samples = self._samples[keep - self._start :]
            self._start = keep
        return frames

    def push(self, samples: np.ndarray) -> mx.array:
        """Mono float32 samples -> the ``(1, n, features)`` frames now complete (lazy)."""
        return log_mel_many([self], [samples])[0]


def log_mel_groups(streams: list[MelStream], chunks: list[np.ndarray]
                   ) -> list[tuple[list[int], mx.array]]:
    """Each stream's :meth:`MelStream.push` of its chunk, by groups of streams whose frames
    have the same shape: ``(rows, (G, n, features) log-mel)``, one device graph a group
    (streams that complete no frame: one group of ``n = 0``)."""
    frames = [stream.take(chunk) for stream, chunk in zip(streams, chunks)]
    groups: dict[tuple, list[int]] = {}
    for b, block in enumerate(frames):
        groups.setdefault(None if block is None else block.shape, []).append(b)
    out = []
    for shape, members in groups.items():
        if shape is None:
            features = streams[members[0]].args.features
            out.append((members, mx.zeros((len(members), 0, features), dtype=mx.float32)))
        else:
            block = np.stack([frames[b] for b in members]) if len(members) > 1 \
                else frames[members[0]][None]
            out.append((members, device_log_mel(mx.array(block), streams[members[0]].args)))
    return out


def log_mel_many(streams: list[MelStream], chunks: list[np.ndarray]) -> list[mx.array]:
    """Each stream's :meth:`MelStream.push` of its chunk, as ``(1, n_b, features)`` each:
    streams whose frames have the same shape share one device graph
    (:func:`log_mel_groups`)."""
    rows: list[mx.array] = [mx.array(0)] * len(streams)
    for members, mel in log_mel_groups(streams, chunks):
        for j, b in enumerate(members):
            rows[b] = take_row(mel, j)
    return rows
