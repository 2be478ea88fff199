"""Perception one 80 ms frame at a time, from persistent state.

With the cache (default): a streaming log-mel frontend keeps only the sample
tail its centred STFT still needs and emits a mel frame once it trails the
input edge by one frame (1280 samples); the cache-aware FastConformer
(:mod:`.encoder_stream`) keeps per layer the last 70 attention inputs and the
last ``kernel - 1`` conv inputs, plus a 16-frame mel cache for the causal
subsampling stack. Work and memory per frame are bounded.

Without the cache (diagnostics): the encoder reruns over the last
``left + right + 1`` frames of audio and takes the second-to-last output (the
last one sees the frontend's right-edge padding).

A :class:`PerceptionStream` is one stream's state: its host-side mel tail
(:class:`~.mel_stream.MelStream`, numpy, trimmed without an evaluation) and
its :class:`EncoderCache`; :meth:`PerceptionStream.push` is a frame of it
alone. :class:`PerceptionRows` is ``B`` streams' state stacked (mlx-lm's
``merge`` / ``extract``), which a caller stepping the same streams keeps
between frames: a frame of it frames the streams' samples on
the host, the tails of one layout as one array (:class:`~.mel_stream.MelRows`),
runs the device half of the log-mel once per shape of frames, then each batch
of equal cache shapes runs the subsampling and the encoder in place.
:func:`push_frames` is one frame of one-stream states (merged, pushed, split
back); one stream is ``B = 1`` of the same code.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ...config import ModelConfig
from .encoder_cache import EncoderCache
from .encoder_stream import EncoderStream
from .mel_stream import MelRows, MelStream, device_groups
from .perception import Perception
from ..rows import RowGroups, stack_rows, take_row


class PerceptionStream:
    """One stream's perception state; :func:`push_frames` advances streams by a frame.

    ``encoder`` is the model's :class:`EncoderStream` (one per loaded model, so
    its graphs compile once; ``VoiceChat`` passes its own); without it the
    stream makes its own.
    """

    def __init__(self, perception: Perception, config: ModelConfig, use_cache: bool = True,
                 encoder: EncoderStream | None = None):
        self.perception = perception
        self.frame_samples = config.frame_samples
        self.use_cache = use_cache
        left, right = perception.att_context
        if use_cache:
            self.mel = MelStream(config.audio_config.preprocessor, self.frame_samples)
            self.encoder = encoder or EncoderStream(
                perception.encoder, left_context=left, positions=perception.window_positions())
            self.cache: EncoderCache = self.encoder.make_cache()
        else:
            self._window_samples = max(2, left + right + 1) * self.frame_samples
            self.window = mx.zeros((0,), dtype=mx.float32)

    @property
    def state(self) -> list[mx.array]:
        """The carried arrays, to evaluate with each frame's outputs (the mel tail is host data)."""
        return self.cache.state if self.use_cache else [self.window]

    @state.setter
    def state(self, arrays: list[mx.array]) -> None:
        if self.use_cache:
            self.cache.state = arrays
        else:
            (self.window,) = arrays

    @property
    def nbytes(self) -> int:
        """The bytes of ``state`` (sized without taking a batch's rows apart)."""
        return self.cache.nbytes if self.use_cache else self.window.nbytes

    def push(self, frame: np.ndarray) -> tuple[mx.array, mx.array]:
        """One ``(frame_samples,)`` frame of this stream alone -> lazy ``(projected, encoded)``,
        each ``(1, 1, D)``: with the cache a batch of one (:func:`push_frames`), without it
        its window rerun. Evaluate them with :attr:`state`."""
        return push_frames([self], [frame]) if self.use_cache else self._rerun(frame)

    def _rerun(self, frame: np.ndarray) -> tuple[mx.array, mx.array]:
        """Without the cache: the whole-signal perception of the last window (diagnostics)."""
        self.window = mx.concatenate([self.window, mx.array(frame)])[-self._window_samples :]
        projected, _, encoded = self.perception.encode_signal(self.window)
        if projected.shape[1] < 2:
            raise RuntimeError("perception returned fewer than two frames for one input frame")
        return projected[:, -2:-1], encoded[:, -2:-1]


class PerceptionRows:
    """The perception state of ``B`` streams of one model stepping together, stacked.

    mlx-lm's cache convention (streams with the cache; one without it pushes
    on its own, :meth:`PerceptionStream.push`): :meth:`merge` takes the
    streams' encoder caches and mel tails into :class:`~.rows.RowGroups`
    (``encoders``: one :class:`EncoderCache` of stacked rows per cache shape,
    streams that started on different frames differing until their windows
    fill; ``mels``: one :class:`~.mel_stream.MelRows` of host tails per
    layout), :meth:`push` advances every row by one frame in place,
    :meth:`split` gives each stream its row back. Whoever steps the same
    streams frame after frame keeps one of these between frames, so a steady
    frame stacks and slices nothing and frames every row in one host
    computation; one stream is ``B = 1`` of the same code, where merging and
    splitting move no data.
    """

    def __init__(self, streams: list[PerceptionStream]):
        """Use :meth:`merge`."""
        if not all(s.use_cache for s in streams):
            raise ValueError("PerceptionRows holds streams with the cache; push the others alone")
        self.streams: list[PerceptionStream] = []
        self.encoders, self.mels = RowGroups([], EncoderCache), RowGroups([], MelRows)
        self.extend(streams)

    @classmethod
    def merge(cls, streams: list[PerceptionStream]) -> "PerceptionRows":
        """The streams' rows, in order; their caches are held here until :meth:`split`."""
        return cls(streams)

    @property
    def state(self) -> list[mx.array]:
        """Every array the rows carry (each batch's once), to evaluate with a frame."""
        return self.encoders.state

    def row_nbytes(self, row: int) -> int:
        """The bytes of row ``row``'s state."""
        return self.encoders.row_nbytes(row)

    def extend(self, streams: list[PerceptionStream]) -> None:
        """``streams``' rows appended after the others'."""
        self.streams += streams
        self.encoders.extend([s.cache for s in streams])
        self.mels.extend([s.mel for s in streams])
        for stream in streams:
            stream.cache = None  # type: ignore[assignment]  # the row is held here

    def remove(self, index: int) -> PerceptionStream:
        """Stream ``index`` with its row back as its own (a copy); the others stay stacked."""
        stream = self.streams.pop(index)
        stream.cache = self.encoders.remove(index)
        self.mels.remove(index)  # writes its tail and counters back
        return stream

    def split(self) -> list[PerceptionStream]:
        """Every stream with its row back as its own cache (a copy)."""
        for stream, cache in zip(self.streams, self.encoders.split()):
            stream.cache = cache
        self.mels.split()  # the tails and counters go back to each stream's own
        return self.streams

    def push(self, frames: list[np.ndarray], clock: Any = None) -> tuple[mx.array, mx.array]:
        """One ``(frame_samples,)`` frame of each row -> lazy ``(projected, encoded)``,
        each ``(B, 1, D)``, row ``b`` stream ``b``'s own.

        The mel tails frame once per layout (host work) and run their device half
        once per shape of frames; each batch of rows runs the encoder stack
        (:meth:`EncoderStream.step`) and the projection takes every row at once.
        Evaluate the results with :attr:`state` (the carried caches), or every
        frame's graph would hang off the previous one. ``clock`` (a profiling
        ``FrameClock``) times the sub-stages when given.
        """
        lengths = {f.shape[0] for f in frames}
        if lengths != {self.streams[0].frame_samples}:
            raise ValueError(f"PerceptionRows.push takes one frame of "
                             f"{self.streams[0].frame_samples} samples a row, got {sorted(lengths)}")
        blocks = [(members, mel.take(np.stack([frames[b] for b in members])))
                  for members, mel in self.mels.groups]
        self.mels.regroup()  # tails whose layouts became equal frame as one from now on
        mels = device_groups(blocks, self.streams[0].mel.args)
        if clock is not None:
            clock.sub_stage("perception.mel", *(m for _, m in mels))
        outs = [(members, self.streams[0].encoder.step(cache, _rows_of(mels, members)))
                for members, cache in self.encoders.groups]
        if any(out.shape[1] != 1 for _, out in outs):
            raise RuntimeError(f"streaming encoder emitted {[o.shape[1] for _, o in outs]} "
                               "frames for one frame")
        encoded = _rows_of(outs, list(range(len(self.streams))))
        if len(outs) > 1:
            self.encoders.regroup()  # batches whose windows filled alike stack as one
        projected = self.streams[0].perception.proj(encoded)
        if clock is not None:
            clock.sub_stage("perception.layers", projected, encoded)
        return projected, encoded


def _rows_of(parts: list[tuple[list[int], mx.array]], rows: list[int]) -> mx.array:
    """Rows ``rows`` of arrays held per group of rows (``(members, [G, ...])``), stacked in
    order: a group whose members are exactly ``rows`` gives its array as it is."""
    for members, array in parts:
        if members == rows:
            return array
    row = {b: take_row(array, j) for members, array in parts for j, b in enumerate(members)}
    return stack_rows([row[b] for b in rows])


def push_frames(streams: list[PerceptionStream], frames: list[np.ndarray],
                clock: Any = None) -> tuple[mx.array, mx.array]:
    """One ``(frame_samples,)`` frame of each stream -> lazy ``(projected, encoded)``, each
    ``(B, 1, D)``: the streams' rows merged for this frame only (:class:`PerceptionRows`),
    pushed and split back. Evaluate the results with each stream's
    :attr:`~PerceptionStream.state`."""
    rows = PerceptionRows.merge(streams)
    try:
        return rows.push(frames, clock)
    finally:
        rows.split()
