"""Streaming log-mel frames, many streams in one graph.

Each stream keeps a bounded host-side sample tail (numpy, trimmed without an
evaluation) and emits a centred mel frame once it trails the input edge by
``lookahead`` samples, as mlx-audio's ``StreamingLogMelSpectrogram`` does over
its ``log_mel_spectrogram_frames``.

The work splits where the data lives. On the host (cheap, the samples are
host data already): preemphasis, the centred STFT's edge padding, framing and
the analysis window, per stream, or once for streams whose tails have one
layout, held stacked (:class:`MelRows`: a pool's streams past their first
frames). On the device, once for every stream whose frames have the same
shape (:func:`device_groups`; at steady state every stream pushes one frame's
worth, so one group): FFT, power, the mel filterbank and the log. A pool step
of ``N`` streams then costs the kernels of one.

Exactness: row by row the result is bit-identical to mlx-audio's
``log_mel_spectrogram_frames`` of that stream alone. The host part does the
same float32 operations element by element (a multiply and a subtract per
preemphasised sample, a multiply per windowed one; IEEE rounding is the same
in numpy and MLX), and the device part is row-wise: the FFT transforms each
frame on its own, and the filterbank matmul's output column for a frame does
not depend on the other columns (``tests/test_mel_stream.py`` checks both).
"""

from __future__ import annotations

import copy
import functools
import math

import mlx.core as mx
import numpy as np
from mlx_audio.dsp import STR_TO_WINDOW_FN, hanning, mel_filters
from mlx_audio.stt.models.nemotron_asr.audio import PreprocessArgs


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
    """Windowed STFT frames ``[start, end)`` of float32 samples ``x`` (``(L,)``, or
    ``(B, L)``: every row's, at once): ``(..., end - start, n_fft)``.

    The host half of mlx-audio's ``log_mel_spectrogram_frames``, the same
    float32 operations element by element: preemphasis with the previous
    sample's state, the centred STFT's edge padding, zero padding to whole
    frames, the window.
    """
    hop, n_fft = args.hop_length, args.n_fft
    count = end - start
    width = x.shape[-1]
    sample_start = start * hop - n_fft // 2
    sample_end = (end - 1) * hop - n_fft // 2 + n_fft
    raw_start, raw_end = max(sample_start, 0), min(sample_end, width)
    raw = x[..., raw_start:raw_end]
    if args.preemph and args.preemph > 0 and raw.shape[-1] > 0:
        alpha = np.float32(args.preemph)
        if raw_start > 0:  # y[n] = x[n] - alpha * x[n - 1], x[n - 1] from before the range
            raw = raw - alpha * x[..., raw_start - 1 : raw_end - 1]
        else:
            raw = np.concatenate([raw[..., :1], raw[..., 1:] - alpha * raw[..., :-1]], axis=-1)
    pieces = []
    for pad, edge in ((max(-sample_start, 0), "left"), (max(sample_end - width, 0), "right")):
        if not pad:
            pieces.append(None)
        elif args.pad_mode == "reflect":
            pieces.append(raw[..., 1 : pad + 1][..., ::-1] if edge == "left"
                          else raw[..., -(pad + 1) : -1][..., ::-1])
        elif args.pad_mode == "constant":
            pieces.append(np.zeros((*raw.shape[:-1], pad), dtype=np.float32))
        else:
            raise ValueError(f"unsupported log-mel pad_mode {args.pad_mode!r}")
    parts = [p for p in (pieces[0], raw, pieces[1]) if p is not None]
    segment = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
    length = (count - 1) * hop + n_fft
    if segment.shape[-1] < length:
        segment = np.pad(segment, [(0, 0)] * (segment.ndim - 1) + [(0, length - segment.shape[-1])])
    frames = np.lib.stride_tricks.sliding_window_view(segment, n_fft, axis=-1)[..., ::hop, :]
    return frames[..., :count, :] * _constants(args)[0]


# The elementwise chains each fuse into one kernel when compiling is on (the
# same operations, so the same bits: tests/test_mel_stream.py).
_power_c = mx.compile(lambda spectrum: mx.square(mx.abs(spectrum)))
_log_c = mx.compile(lambda mel, guard: mx.log(mel + guard))


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
    samples. :meth:`push` is one stream alone; streams framing together are a
    :class:`MelRows`.
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
        or ``None`` when none is: this stream as a :class:`MelRows` of one, whose
        arithmetic every pool step runs."""
        rows = MelRows([self])
        frames = rows.take(samples[None])
        rows.extract(0)
        return None if frames is None else frames[0]

    def key(self) -> tuple:
        """What streams must share to frame as one (:class:`MelRows`): their tails' length,
        where their next frame starts in it, and whether the tail is the stream's start."""
        return (self._total - self._start, self._next_frame - self._start // self.args.hop_length,
                self._start == 0)

    def push(self, samples: np.ndarray) -> mx.array:
        """Mono float32 samples -> the ``(1, n, features)`` frames now complete (lazy)."""
        frames = self.take(samples)
        return device_groups([([0], None if frames is None else frames[None])], self.args)[0][1]


class MelRows:
    """``B`` streams' mel frontends framing together, stacked (mlx-lm's ``merge`` /
    ``extract``): their sample tails one ``(B, L)`` host array, their counters one set,
    relative to the tails, which streams of one :meth:`MelStream.key` share (the
    same arithmetic as :meth:`MelStream.take` on each, the sample start of every tail
    being a whole hop). A chunk of every row is framed in one host computation
    (:func:`host_frames` of ``(B, L)``). While merged, the streams' own counters are
    stale: :meth:`extract` writes one back.
    """

    def __init__(self, streams: list[MelStream]):
        """Use :meth:`merge`."""
        lead = streams[0]
        self.streams = list(streams)
        self.args, self.lookahead = lead.args, lead.lookahead
        self._lookbehind_frames = lead._lookbehind_frames
        self._samples = (lead._samples[None] if len(streams) == 1
                         else np.stack([s._samples for s in streams]))
        self._starts = [s._start for s in streams]  # each tail's stream index at the merge
        self._moved = 0  # samples every tail dropped since
        self._total, self._next, self._fresh = lead.key()

    @classmethod
    def merge(cls, streams: list[MelStream]) -> "MelRows":
        layouts = {s.key() for s in streams}
        if len(layouts) != 1:
            raise ValueError(f"mel streams of layouts {sorted(layouts)} do not frame as one")
        return cls(streams)

    def key(self) -> tuple:
        """Its rows' :meth:`MelStream.key`."""
        return self._total, self._next, self._fresh

    def take(self, chunks: np.ndarray) -> np.ndarray | None:
        """``(B, n)`` mono samples in -> every row's windowed frames now complete
        (``(B, count, n_fft)``, host), or ``None`` when none is."""
        hop = self.args.hop_length
        self._samples = np.concatenate([self._samples, chunks.astype(np.float32, copy=False)],
                                       axis=1)
        self._total += chunks.shape[1]
        centre = self._total - self.lookahead
        # A tail past its stream's start begins at a whole hop after a frame centre that
        # was complete: its centre is never before the stream's start.
        end = centre // hop + 1 if centre >= 0 or not self._fresh else 0
        if end <= self._next:
            return None
        frames = host_frames(self._samples, self.args, self._next, end)
        self._next = end
        keep = max(end - self._lookbehind_frames, 0) * hop
        if keep > 0:
            self._samples = self._samples[:, keep:]
            self._moved += keep
            self._total -= keep
            self._next -= keep // hop
            self._fresh = False
        return frames

    def extract(self, index: int, copy: bool = True) -> MelStream:
        """Stream ``index`` with its tail and counters written back (``copy=False``: its
        tail a view of the stacked one, for a stream stacked again at once)."""
        stream, tail = self.streams[index], self._samples[index]
        stream._samples = tail.copy() if copy and len(self.streams) > 1 else tail
        stream._start = self._starts[index] + self._moved
        stream._total = stream._start + self._total
        stream._next_frame = self._next + stream._start // self.args.hop_length
        return stream

    def filter(self, keep: list[int]) -> "MelRows":
        """Rows ``keep`` (ascending) framing together as before, their tails copied."""
        kept = copy.copy(self)
        kept.streams = [self.streams[b] for b in keep]
        kept._samples = self._samples[keep]
        kept._starts = [self._starts[b] for b in keep]
        return kept


def device_groups(blocks: list[tuple[list[int], np.ndarray | None]], args: PreprocessArgs
                  ) -> list[tuple[list[int], mx.array]]:
    """Host frame blocks of rows (``(rows, (G, n, n_fft))``, ``None``: no frame) -> their
    log-mel, the blocks of one shape stacked into one device graph: ``(rows, (G', n,
    features))`` per shape (rows that completed no frame: one group of ``n = 0``)."""
    shapes: dict[tuple | None, list[tuple[list[int], np.ndarray | None]]] = {}
    for rows, block in blocks:
        shapes.setdefault(None if block is None else block.shape[1:], []).append((rows, block))
    out = []
    for shape, parts in shapes.items():
        rows = [b for members, _ in parts for b in members]
        if shape is None:
            out.append((rows, mx.zeros((len(rows), 0, args.features), dtype=mx.float32)))
        else:
            block = parts[0][1] if len(parts) == 1 else np.concatenate([p for _, p in parts])
            out.append((rows, device_log_mel(mx.array(block), args)))
    return out
