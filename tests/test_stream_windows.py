"""Work a streaming window would repeat every frame is done once, with the same bits."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.models.perception_stream import PerceptionStream
from mlx_voicechat_plugin.testing.fixtures import conversation_signal


@pytest.fixture(scope="module")
def small(small_ckpt):
    return load(small_ckpt)


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b))


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
    assert first._encoder.positions is second._encoder.positions


def test_filling_windows_encode_as_projecting_each_length(small):
    model = small[0]
    perception = model.stt_model.perception
    sliced = PerceptionStream(perception, model.config)
    direct = PerceptionStream(perception, model.config)
    direct._encoder.positions = None
    audio = conversation_signal(2.0)
    frame = model.config.frame_samples
    for start in range(0, len(audio) - frame + 1, frame):
        got, expected = sliced.step(audio[start : start + frame]), direct.step(audio[start : start + frame])
        assert all(_equal(a, b) for a, b in zip(got, expected))
