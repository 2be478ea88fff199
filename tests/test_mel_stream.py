"""The streaming log-mel frontend: many streams in one graph, each row its stream alone.

Every comparison is bit for bit: the batched frontend against each stream run
alone, and both against mlx-audio's ``log_mel_spectrogram_frames`` /
``StreamingLogMelSpectrogram`` (the frontend the reference's features come from).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_audio.stt.models.nemotron_asr import StreamingLogMelSpectrogram
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram_frames

from mlx_voicechat_plugin.config import ModelConfig
from mlx_voicechat_plugin.models.perception.mel_stream import (
    MelRows, MelStream, device_groups, device_log_mel, host_frames)
from mlx_voicechat_plugin.runtime import compile_policy
from mlx_voicechat_plugin.instruments.kernels import graph_primitives, kernel_count
from mlx_voicechat_plugin.testing.configs import fixture_config
from mlx_voicechat_plugin.testing.fixtures import question_signal


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_dict(fixture_config("tiny"))


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b))


@pytest.mark.parametrize("pad_mode", ["reflect", "constant"])
def test_host_frames_then_device_equal_mlx_audio_frames(config, pad_mode):
    args = dataclasses.replace(config.audio_config.preprocessor, pad_mode=pad_mode)
    x = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    last = x.shape[0] // args.hop_length + 1
    # the left edge (padding), the middle, the right edge (padding), one frame
    for start, end in [(0, 8), (0, 1), (3, 11), (20, last), (last - 1, last), (7, 8)]:
        got = device_log_mel(mx.array(host_frames(x, args, start, end))[None], args)
        assert _equal(got, log_mel_spectrogram_frames(mx.array(x), args, start, end)), (start, end)


def log_mel_many(streams: list[MelStream], chunks: list[np.ndarray]) -> list[mx.array]:
    """Each stream's chunk framed on its own, the device work of every stream whose frames
    have one shape run as one graph (``device_groups``, as a pool step runs it):
    ``(1, n_b, features)`` each."""
    blocks = [([b], None if frames is None else frames[None])
              for b, frames in enumerate(s.take(c) for s, c in zip(streams, chunks))]
    rows: list[mx.array] = [mx.array(0)] * len(streams)
    for members, mel in device_groups(blocks, streams[0].args):
        for j, b in enumerate(members):
            rows[b] = mel[j : j + 1]
    return rows


def _solo_and_batched(config, starts: list[int], chunk: int, frames: int):
    """Streams starting ``starts[b]`` chunks late, pushed ``chunk`` samples at a time
    for ``frames`` steps: each step's batched rows and the same streams alone."""
    args = config.audio_config.preprocessor
    lookahead = config.frame_samples
    batched = [MelStream(args, lookahead) for _ in starts]
    alone = [MelStream(args, lookahead) for _ in starts]
    theirs = [StreamingLogMelSpectrogram(args, lookahead_samples=lookahead) for _ in starts]
    signals = [question_signal(4.0, seed=b) for b in range(len(starts))]
    shapes_seen = []
    for step in range(frames):
        live = [b for b, s in enumerate(starts) if step >= s]
        pieces = [signals[b][(step - starts[b]) * chunk:(step - starts[b] + 1) * chunk] for b in live]
        rows = log_mel_many([batched[b] for b in live], pieces)
        shapes_seen.append(sorted(r.shape[1] for r in rows))
        for b, piece, row in zip(live, pieces, rows):
            solo = alone[b].push(piece)
            assert _equal(row, solo), (step, b)
            assert _equal(row, theirs[b].push(mx.array(piece))), (step, b)
    return shapes_seen


def test_a_batch_of_streams_equals_each_stream_alone(config):
    # Streams a frame apart carry different tails at first (shapes differ: separate groups),
    # then push equal shapes (one group).
    shapes = _solo_and_batched(config, starts=[0, 0, 1, 3, 3], chunk=config.frame_samples, frames=8)
    assert any(len(set(s)) > 1 for s in shapes)  # some step had groups of different shapes
    assert len(set(shapes[-1])) == 1 and len(shapes[-1]) == 5  # steady state: one group


def test_streams_at_different_points_of_odd_chunks_equal_each_alone(config):
    # 700-sample chunks straddle frames: the streams emit 4 or 5 frames, or none, per push.
    shapes = _solo_and_batched(config, starts=[0, 1, 2, 5], chunk=700, frames=14)
    assert any(0 in s for s in shapes) and any(len(set(s) - {0}) > 1 for s in shapes)


@pytest.mark.parametrize("chunk", [1280, 700])
def test_stacked_tails_frame_as_each_stream_alone_and_go_on_alone_after(config, chunk):
    """Streams of one layout held as one ``(B, L)`` tail (:class:`MelRows`) frame every
    row in one host computation, each row its stream's frames alone, bit for bit; split,
    each stream goes on alone from where the batch left it."""
    args = config.audio_config.preprocessor
    lookahead = config.frame_samples
    signals = [question_signal(3.0, seed=b) for b in range(3)]
    held = [MelStream(args, lookahead) for _ in signals]
    alone = [MelStream(args, lookahead) for _ in signals]

    def piece(b: int, step: int) -> np.ndarray:
        return signals[b][step * chunk:(step + 1) * chunk]

    def same(a, e) -> bool:
        return (a is None and e is None) or np.array_equal(a, e)

    for step in range(2):  # the same layout from the start (and past it, below)
        for b in range(3):
            assert same(held[b].take(piece(b, step)), alone[b].take(piece(b, step)))
    rows = MelRows.merge(held)
    for step in range(2, 12):
        got = rows.take(np.stack([piece(b, step) for b in range(3)]))
        expected = [alone[b].take(piece(b, step)) for b in range(3)]
        if got is None:
            assert all(e is None for e in expected)
            continue
        for b in range(3):
            assert np.array_equal(got[b], expected[b]), (step, b)
    for b in range(3):
        rows.extract(b)
    for step in range(12, 16):
        for b in range(3):
            assert same(held[b].take(piece(b, step)), alone[b].take(piece(b, step))), (step, b)
    with pytest.raises(ValueError, match="layouts"):
        MelRows.merge([held[0], MelStream(args, lookahead)])


def test_steady_streams_cost_the_kernels_of_one(config):
    args = config.audio_config.preprocessor
    frame = config.frame_samples

    def kernels(n: int) -> int:
        streams = [MelStream(args, frame) for _ in range(n)]
        signals = [question_signal(2.0, seed=b) for b in range(n)]
        for step in range(3):  # past the stream start, where the left edge is padded
            rows = log_mel_many(streams, [s[step * frame:(step + 1) * frame] for s in signals])
            mx.eval(rows)
        rows = log_mel_many(streams, [s[3 * frame:4 * frame] for s in signals])
        return kernel_count(graph_primitives(*rows))

    one = kernels(1)
    assert 0 < one <= 7
    assert kernels(16) == one


def test_compiled_log_mel_equals_uncompiled(config):
    args = config.audio_config.preprocessor
    rng = np.random.default_rng(2)
    frames = mx.array(rng.standard_normal((6, 8, args.n_fft)).astype(np.float32))

    def run(compiled: bool) -> mx.array:
        mx.enable_compile() if compiled else mx.disable_compile()
        out = device_log_mel(frames, args)
        mx.eval(out)
        return out

    was = compile_policy.enabled()
    try:
        fused, plain = run(True), run(False)
    finally:  # back to what it was
        mx.enable_compile() if was else mx.disable_compile()
    assert _equal(fused, plain)
