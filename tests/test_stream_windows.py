"""Work a streaming window would repeat every frame is done once, with the same bits."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.models.perception.perception_stream import PerceptionStream, push_frames
from mlx_voicechat_plugin.testing.fixtures import conversation_signal, question_signal


@pytest.fixture(scope="module")
def small(small_ckpt):
    return load(small_ckpt)


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b))


def _step(stream, chunk):
    """One frame of one stream, evaluated with its carried state."""
    projected, encoded = push_frames([stream], [chunk])
    mx.eval(projected, encoded, *stream.state)
    return projected, encoded


def test_every_window_length_slices_the_full_windows_positional_projection(small):
    perception = small[0].stt_model.perception
    table = perception.window_positions()
    encoder = perception.encoder
    for length in range(1, table.window + 1):
        direct = encoder.pos_enc.pos_emb_for(length, mx.float32)
        for index, layer in enumerate(encoder.layers):
            assert _equal(table.for_length(index, length), layer.self_attn.linear_pos(direct))


def test_the_positional_table_is_computed_once_per_model(small):
    model = small[0]
    config = model.config
    first = PerceptionStream(model.stt_model.perception, config)
    second = PerceptionStream(model.stt_model.perception, config)
    assert first.encoder.positions is second.encoder.positions


def test_filling_windows_encode_as_projecting_each_length(small):
    model = small[0]
    perception = model.stt_model.perception
    sliced = PerceptionStream(perception, model.config)
    direct = PerceptionStream(perception, model.config)
    direct.encoder.positions = None
    audio = conversation_signal(2.0)
    frame = model.config.frame_samples
    for start in range(0, len(audio) - frame + 1, frame):
        got, expected = _step(sliced, audio[start : start + frame]), _step(direct, audio[start : start + frame])
        assert all(_equal(a, b) for a, b in zip(got, expected))


def test_streams_filling_their_windows_together_batch_and_equal_each_alone(small, monkeypatch):
    """Streams that started on the same frame have equal cache shapes while their windows
    fill: they run as one batch, and every frame's output is each stream's own."""
    from mlx_voicechat_plugin.models.perception.encoder_stream import EncoderStream

    model = small[0]
    perception = model.stt_model.perception
    frame = model.config.frame_samples
    signals = [question_signal(6.4, seed=seed) for seed in range(3)]
    alone = [PerceptionStream(perception, model.config) for _ in signals]
    together = [PerceptionStream(perception, model.config) for _ in signals]
    late = PerceptionStream(perception, model.config)  # starts later: never shares shapes
    rows = []  # the rows of each batch of more than one stream
    original = EncoderStream.__call__
    monkeypatch.setattr(EncoderStream, "__call__", lambda self, cache, x: (
        cache.batch_size > 1 and rows.append(cache.batch_size)) or original(self, cache, x))
    frames = len(signals[0]) // frame
    filling = together[0].encoder.left_context
    for index in range(frames):
        chunk = [s[index * frame : (index + 1) * frame] for s in signals]
        expected = [push_frames([stream], [c]) for stream, c in zip(alone, chunk)]
        streams, inputs = together, chunk
        if index >= 3:
            streams, inputs = together + [late], chunk + [chunk[0]]
        projected, encoded = push_frames(streams, inputs)
        got = [(projected[b : b + 1], encoded[b : b + 1]) for b in range(len(streams))]
        for (p, e), (p0, e0) in zip(got, expected):
            assert _equal(p, p0) and _equal(e, e0), index
    assert frames > filling
    assert len(rows) >= filling and all(n == 3 for n in rows[:filling]), rows[:5]


def test_encoder_caches_merge_extract_and_set_state_row_for_row(small):
    """mlx-lm's cache convention: ``merge`` stacks streams' caches, ``extract(i)`` gives
    stream ``i``'s back, and ``state`` set on a new cache restores its arrays."""
    from mlx_voicechat_plugin.models.perception.encoder_cache import EncoderCache

    model = small[0]
    frame = model.config.frame_samples
    streams = [PerceptionStream(model.stt_model.perception, model.config) for _ in range(2)]
    signals = [question_signal(0.4, seed=seed) for seed in range(2)]
    for start in range(0, 5 * frame, frame):
        _, encoded = push_frames(streams, [s[start : start + frame] for s in signals])
        mx.eval(encoded, *[a for s in streams for a in s.state])
    merged = EncoderCache.merge([s.cache for s in streams])
    assert merged.batch_size == 2 and merged.key() == streams[0].cache.key()
    for index, stream in enumerate(streams):
        row = merged.extract(index)
        assert len(row.state) == len(stream.cache.state)
        assert all(_equal(a, b) for a, b in zip(row.state, stream.cache.state))
    restored = streams[0].encoder.make_cache()
    restored.state = streams[0].cache.state
    assert all(_equal(a, b) for a, b in zip(restored.state, streams[0].cache.state))
    assert restored.key() == streams[0].cache.key()


def test_one_querys_relative_shift_is_its_row_as_it_was(small):
    """The streaming encoder skips the relative shift for one new frame: for one query
    it pads a zero in front, reads the row one step later and drops the zero."""
    attn = small[0].stt_model.perception.encoder.layers[0].self_attn
    scores = mx.random.normal((2, attn.n_head, 1, 141), key=mx.random.key(2))
    assert _equal(attn.rel_shift(scores), scores)


def test_steady_streams_frame_and_subsample_with_the_kernels_of_one(small):
    """The mel frontend, the subsampling window (kept frames + new frames) and the encoder
    of streams with equal shapes, held stacked, are one graph: a step of four costs the
    kernels of one."""
    from mlx_voicechat_plugin.models.perception.perception_stream import PerceptionRows
    from mlx_voicechat_plugin.instruments.kernels import graph_primitives, kernel_count

    model = small[0]
    frame = model.config.frame_samples

    def kernels(n: int) -> int:
        streams = [PerceptionStream(model.stt_model.perception, model.config) for _ in range(n)]
        signals = [question_signal(1.0, seed=seed) for seed in range(n)]
        rows = PerceptionRows.merge(streams)  # held stacked, as a pool's batch holds them
        for index in range(4):  # past the streams' first frames
            outs = rows.push([s[index * frame : (index + 1) * frame] for s in signals])
            mx.eval(*outs, *rows.state)
        assert len(rows.encoders.groups) == 1 and len(rows.mels.groups) == 1  # one batch, one mel tail block
        outs = rows.push([s[4 * frame : 5 * frame] for s in signals])
        return kernel_count(graph_primitives(*outs))

    assert kernels(4) == kernels(1)


def test_a_perception_batch_takes_one_whole_frame_a_row_and_stays_usable(small):
    """Streams framing together take whole frames (a stream cuts them; its flush pads the
    last): a short one is refused with the length it wants, and the streams go on."""
    model = small[0]
    frame = model.config.frame_samples
    signals = [question_signal(0.5, seed=seed) for seed in range(2)]
    streams = [PerceptionStream(model.stt_model.perception, model.config) for _ in signals]
    alone = [PerceptionStream(model.stt_model.perception, model.config) for _ in signals]
    with pytest.raises(ValueError, match=f"one frame of {frame} samples a row, got \\[700, {frame}\\]"):
        push_frames(streams, [signals[0][:frame], signals[1][:700]])
    for index in range(3):
        chunk = [s[index * frame : (index + 1) * frame] for s in signals]
        projected, encoded = push_frames(streams, chunk)
        for b, stream in enumerate(alone):
            p, e = _step(stream, chunk[b])
            assert _equal(projected[b : b + 1], p) and _equal(encoded[b : b + 1], e), index
