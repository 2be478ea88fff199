"""Transposed weight storage changes nothing but speed (``models/weight_layout.py``).

Each rewritten layer is checked bit for bit against the MLX layer it stands in
for, and a model loaded with the layout moved against the same checkpoint
loaded with the layout kept: every parameter, the float outputs of each
stage and a whole stream's events.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.models import weight_layout
from mlx_voicechat_plugin.models.perception.perception_stream import PerceptionStream, push_frames
from mlx_voicechat_plugin.models.rnnt.prediction_step import held_lstm, lstm_step
from mlx_voicechat_plugin.models.weight_layout import (
    FrameUpsample, PointwiseConv1d, RowMajorLinear, RowMajorLSTM, layouts_agree, relayout,
)
from mlx_voicechat_plugin.runtime.rng import RandomStream
from mlx_voicechat_plugin.runtime.timeline import Timeline
from mlx_voicechat_plugin.runtime.warm_start import WarmStart
from mlx_voicechat_plugin.testing.fixtures import conversation_signal

pytestmark = pytest.mark.skipif(not layouts_agree(),
                                reason="this device's products depend on the layout")

ROWS = (1, 2, 9)


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(
        np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))))


def _pair(make) -> tuple[nn.Module, nn.Module]:
    """``make()`` twice with the same parameters: as built, and relaid out."""
    layer, holder = make(), nn.Module()
    holder.layer = make()
    holder.layer.update(layer.parameters())
    assert relayout(holder) > 0
    return layer, holder.layer


@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_layer_gives_the_same_bits_transposed(bias):
    layer, moved = _pair(lambda: nn.Linear(96, 257, bias=bias))
    assert type(moved) is (RowMajorLinear if bias else nn.Linear)
    for rows in ROWS:
        x = mx.random.normal((1, rows, 96), key=mx.random.key(rows))
        assert _same(moved(x), layer(x))


def test_a_biased_linear_layer_needs_its_bias_after_the_product():
    # The reason for RowMajorLinear: addmm on the moved weight rounds differently.
    layer = nn.Linear(96, 257)
    moved = weight_layout.row_major(layer.weight)
    x = mx.random.normal((2, 96), key=mx.random.key(0))
    assert not _same(mx.addmm(layer.bias, x, moved.T), layer(x))
    assert _same(x @ moved.T + layer.bias, layer(x))


@pytest.mark.parametrize("bias", [False, True])
def test_a_kernel_one_convolution_gives_the_same_bits_as_a_product(bias):
    layer, moved = _pair(lambda: nn.Conv1d(64, 130, 1, bias=bias))
    assert type(moved) is PointwiseConv1d
    for rows in ROWS:
        x = mx.random.normal((2, rows, 64), key=mx.random.key(rows))
        assert _same(moved(x), layer(x))


def test_a_frame_rate_transposed_convolution_gives_the_same_bits_as_a_product():
    layer, moved = _pair(lambda: nn.ConvTranspose1d(48, 40, 7, stride=7, bias=False))
    assert type(moved) is FrameUpsample
    for rows in ROWS:
        x = mx.random.normal((1, rows, 48), key=mx.random.key(rows))
        assert _same(moved(x), layer(x))


def test_other_convolutions_keep_their_layout():
    for layer in (nn.Conv1d(8, 8, 3), nn.Conv1d(8, 8, 1, stride=2),
                  nn.ConvTranspose1d(8, 8, 4, stride=2)):
        holder = nn.Module()
        holder.layer = layer
        assert relayout(holder) == 0


def test_an_lstm_gives_the_same_bits_transposed():
    layer, moved = _pair(lambda: nn.LSTM(64, 96))
    assert type(moved) is RowMajorLSTM
    x = mx.random.normal((1, 5, 64), key=mx.random.key(1))
    h = mx.random.normal((1, 96), key=mx.random.key(2))
    c = mx.random.normal((1, 96), key=mx.random.key(3))
    for got, expected in zip(moved(x, h, c), layer(x, h, c)):
        assert _same(got, expected)


def test_the_rnnt_lstm_step_gives_the_same_bits_transposed():
    stock, moved = zip(*[_pair(lambda: nn.LSTM(64, 64)) for _ in range(2)])
    x = mx.random.normal((1, 64), key=mx.random.key(1))
    h = [mx.random.normal((1, 64), key=mx.random.key(k)) for k in (2, 3)]
    c = [mx.random.normal((1, 64), key=mx.random.key(k)) for k in (4, 5)]
    got, expected = lstm_step(list(moved), x, h, c), lstm_step(list(stock), x, h, c)
    assert _same(got[0], expected[0])
    assert all(_same(a, b) for a, b in zip([*got[1], *got[2]], [*expected[1], *expected[2]]))


def test_the_rnnt_lstm_step_holds_bf16_weights_in_float32_with_the_same_bits():
    # The RNNT's case: a bf16 layer meets a bf16 embedding and the float32 state.
    layers = [nn.LSTM(64, 64) for _ in range(2)]
    for layer in layers:
        layer.update({k: v.astype(mx.bfloat16) for k, v in layer.parameters().items()})
    x = mx.random.normal((1, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    h = [mx.random.normal((1, 64), key=mx.random.key(k)) for k in (2, 3)]
    c = [mx.random.normal((1, 64), key=mx.random.key(k)) for k in (4, 5)]
    held = held_lstm(layers)
    got, expected = lstm_step(layers, x, h, c, held), lstm_step(layers, x, h, c)
    assert _same(got[0], expected[0])
    assert all(_same(a, b) for a, b in zip([*got[1], *got[2]], [*expected[1], *expected[2]]))


@pytest.mark.parametrize("weights", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_rnnt_lstm_step_is_the_stock_layers_step_for_every_dtype_mix(weights, compiled):
    # The gates' adds run gate by gate inside their fused kernel where the
    # products are held float32: still each layer's own nn.LSTM step, bit for bit.
    layers = [nn.LSTM(64, 64) for _ in range(2)]
    for layer in layers:
        layer.update({k: v.astype(weights) for k, v in layer.parameters().items()})
    x = mx.random.normal((3, 64), key=mx.random.key(1)).astype(weights)
    h = [mx.random.normal((3, 64), key=mx.random.key(k)) for k in (2, 3)]
    c = [mx.random.normal((3, 64), key=mx.random.key(k)) for k in (4, 5)]
    held = held_lstm(layers)
    step = mx.compile(lambda *a: lstm_step(layers, a[0], [*a[1:3]], [*a[3:]], held)) \
        if compiled else (lambda *a: lstm_step(layers, a[0], [*a[1:3]], [*a[3:]], held))
    top, got_h, got_c = step(x, *h, *c)
    inputs = x
    for index, layer in enumerate(layers):
        all_h, all_c = layer(inputs[:, None], hidden=h[index], cell=c[index])
        assert _same(got_h[index], all_h[:, -1]) and _same(got_c[index], all_c[:, -1])
        inputs = all_h[:, -1]
    assert _same(top, inputs)


def test_sessions_of_one_model_share_the_held_lstm_weights(tiny_ckpt):
    model, processor = load(tiny_ckpt)
    first, second = model.create_session(processor), model.create_session(processor)
    assert first._rnnt._held is not None and first._rnnt._held is second._rnnt._held
    assert not any("held" in k for k, _ in tree_flatten(model.parameters()))


def test_nothing_moves_where_the_layouts_round_differently(monkeypatch, tiny_ckpt):
    monkeypatch.setattr(weight_layout, "layouts_agree", lambda dtype=None: False)
    model, _ = load(tiny_ckpt)
    assert model.layout_moved == 0
    assert not any(isinstance(m, (RowMajorLinear, PointwiseConv1d, FrameUpsample, RowMajorLSTM))
                   for _, m in model.named_modules())


@pytest.fixture(scope="module")
def pair(small_ckpt):
    """The small checkpoint loaded with the layout moved, and with it kept."""
    moved = load(small_ckpt)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weight_layout, "layouts_agree", lambda dtype=None: False)
        kept = load(small_ckpt)
    assert moved[0].layout_moved > 0 and kept[0].layout_moved == 0
    return moved, kept


def test_loading_moves_every_float32_matrix_and_keeps_every_parameter(pair):
    (moved, _), (kept, _) = pair
    got, expected = dict(tree_flatten(moved.parameters())), dict(tree_flatten(kept.parameters()))
    assert got.keys() == expected.keys()
    assert all(_same(got[k], expected[k]) for k in got)
    f32_linears = [m for _, m in moved.named_modules()
                   if isinstance(m, nn.Linear) and m.weight.dtype == mx.float32]
    assert moved.layout_moved >= len(f32_linears) - 1  # all but the MoG head's proj_mus


def test_the_perception_stream_gives_the_same_bits(pair):
    (moved, _), (kept, _) = pair
    audio = conversation_signal(2.0)
    frame = moved.config.frame_samples
    streams = [PerceptionStream(m.stt_model.perception, m.config) for m in (moved, kept)]
    for start in range(0, len(audio) - frame + 1, frame):
        outs = [push_frames([s], [audio[start : start + frame]]) for s in streams]
        mx.eval(outs, *[a for s in streams for a in s.state])
        assert all(_same(a, b) for a, b in zip(*outs))


def test_the_language_model_gives_the_same_logits(pair):
    (moved, _), (kept, _) = pair
    caches = [m.stt_model.make_state() for m in (moved, kept)]
    hidden = moved.config.text_config.hidden_size
    for t in range(5):
        x = mx.random.normal((1, 1, hidden), key=mx.random.key(t))
        outs = [m.stt_model.step(x, [c]) for m, c in zip((moved, kept), caches)]
        assert all(_same(a, b) for a, b in zip(*outs))


def test_the_rnnt_gives_the_same_symbols_and_state(pair):
    (moved, _), (kept, _) = pair
    greedy = [m.create_session(p)._rnnt for m, p in pair]
    carries = [g.initial(mx.float32) for g in greedy]
    d_model = moved.config.audio_config.encoder.d_model
    for t in range(4):
        encoded = mx.random.normal((1, 1, d_model), key=mx.random.key(t))
        logits = [g.joint(encoded, c.state[0][None]) for g, c in zip(greedy, carries)]
        assert _same(*logits)
        symbols = [g(encoded, c, g.max_symbols) for g, c in zip(greedy, carries)]  # c updated
        assert _same(symbols[0], symbols[1])
        assert all(_same(a, b) for a, b in zip(carries[0].state, carries[1].state))


def test_the_tts_gives_the_same_hidden_states_and_codes(pair):
    timelines = [Timeline(m, WarmStart.of(m)) for m, _ in pair]
    rngs = [RandomStream(3), RandomStream(3)]
    text = mx.array([[7]], dtype=mx.int32)
    for _ in range(4):
        tts = [t.model.tts_model.tts_model for t in timelines]
        hidden = [m.backbone_step(t.prev_codes, text, t.tts_caches, [7])
                  for m, t in zip(tts, timelines)]
        assert _same(*hidden)
        codes = [m.generate_codes(h, [r]) for m, h, r in zip(tts, hidden, rngs)]
        assert _same(*codes)
        for t, c in zip(timelines, codes):
            t.prev_codes = c


def _events(model, processor, seconds: float) -> list:
    stream = model.create_session(processor).create_streaming_session()
    audio = conversation_signal(seconds)
    frame = model.config.frame_samples
    events = []
    for start in range(0, len(audio) - frame + 1, frame):
        events += stream.push_audio(audio[start : start + frame])
    return events + stream.flush()


def _event_key(event) -> tuple:
    fields = []
    for value in vars(event).values():
        fields.append(value.tobytes() if isinstance(value, np.ndarray) else value)
    return (type(event).__name__, *fields)


def test_a_stream_gives_the_same_events_and_samples(pair):
    got, expected = (_events(m, p, 3.0) for m, p in pair)
    assert [_event_key(e) for e in got] == [_event_key(e) for e in expected]
