"""RoPE tables and per-row RMSNorm weights: the fast ops' fallbacks, bit for bit.

Where ``mx.fast`` ops expand (MLX's CPU backend), the EAR-TTS backbone step
computes each RoPE's cosines and sines once per step and norms and rotates q
and k as one (:mod:`mlx_voicechat_plugin.models.fast_forms`). Each form must
give exactly what ``mx.fast.rope`` / ``mx.fast.rms_norm`` give, for every dtype,
offset and base the backbone meets; off the CPU the step keeps ``mx.fast``.
No tolerance anywhere: ``mx.array_equal``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from backbone_support import backbone_steps

from mlx_voicechat_plugin.models import fast_forms
from mlx_voicechat_plugin.models.fast_forms import RopeForm, rms_norm
from mlx_voicechat_plugin.models.speech.gemma_step import GemmaStep
from mlx_voicechat_plugin.instruments.kernels import graph_primitives
from mlx_voicechat_plugin.runtime.timeline import Timeline

DTYPES = (mx.float32, mx.bfloat16, mx.float16)
# Gemma-3's local and global bases, and one far from both.
BASES = (10_000.0, 1_000_000.0, 500.0)
OFFSETS = (0, 1, 63, 64, 4095, 100_000, 2_000_003)


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b))


def _rows(shape: tuple[int, ...], dtype: mx.Dtype, seed: int) -> mx.array:
    return (3 * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", BASES)
def test_rope_from_tables_equals_fast_rope_at_one_offset_per_row(dtype, base):
    x = _rows((len(OFFSETS), 4, 1, 64), dtype, seed=1)
    offset = mx.array(OFFSETS, dtype=mx.int32)
    form = RopeForm.of(nn.RoPE(64, base=base))
    assert form is not None
    expected = mx.fast.rope(x, 64, traditional=False, base=base, scale=1.0, offset=offset)
    assert _equal(form(x, *form.angles(offset)), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", (0, 7, 70_000))
def test_rope_from_tables_equals_fast_rope_at_a_scalar_offset_and_several_positions(
    dtype, offset
):
    x = _rows((2, 3, 5, 32), dtype, seed=2)
    form = RopeForm.of(nn.RoPE(32, base=10_000.0))
    off = mx.array(offset, dtype=mx.int32)
    expected = mx.fast.rope(x, 32, traditional=False, base=10_000.0, scale=1.0, offset=off)
    assert _equal(form(x, *form.angles(off, length=5)), expected)


@pytest.mark.parametrize("dtype", (mx.float32, mx.bfloat16))
def test_partial_rotary_dims_leave_the_rest_of_the_head_as_it_was(dtype):
    x = _rows((3, 2, 1, 96), dtype, seed=3)
    offset = mx.array([5, 900, 33_000], dtype=mx.int32)
    form = RopeForm.of(nn.RoPE(48, base=1_000_000.0))
    got = form(x, *form.angles(offset))
    assert _equal(got, mx.fast.rope(x, 48, traditional=False, base=1_000_000.0, scale=1.0,
                                    offset=offset))
    assert _equal(got[..., 48:], x[..., 48:])


def test_a_scaled_rope_rotates_at_scaled_positions_as_fast_rope():
    x = _rows((2, 2, 1, 64), mx.float32, seed=4)
    offset = mx.array([3, 40_000], dtype=mx.int32)
    form = RopeForm.of(nn.RoPE(64, base=1_000_000.0, scale=0.125))
    expected = mx.fast.rope(x, 64, traditional=False, base=1_000_000.0, scale=0.125,
                            offset=offset)
    assert _equal(form(x, *form.angles(offset)), expected)


def test_one_table_serves_every_input_at_the_same_offsets_in_a_compiled_step():
    """Tables computed once, rotating q and k (different head counts) in a compiled
    function, give each what its own mx.fast.rope call gives."""
    form = RopeForm.of(nn.RoPE(64, base=10_000.0))
    offset = mx.array([12, 12, 77_777, 77_777], dtype=mx.int32)
    q, k = _rows((4, 8, 1, 64), mx.bfloat16, 5), _rows((4, 2, 1, 64), mx.bfloat16, 6)
    angles = mx.compile(form.angles)(offset)
    got = mx.compile(lambda q, k, c, s: (form(q, c, s), form(k, c, s)))(q, k, *angles)
    for x, y in zip((q, k), got):
        assert _equal(y, mx.fast.rope(x, 64, traditional=False, base=10_000.0, scale=1.0,
                                      offset=offset))


def test_ropes_without_a_form_are_refused():
    assert RopeForm.of(nn.RoPE(64, traditional=True)) is None
    assert RopeForm.of(object()) is None

    class OwnRope(nn.RoPE):  # a subclass may rotate differently
        pass

    assert RopeForm.of(OwnRope(64)) is None


def test_the_probe_catches_a_frequency_one_ulp_off():
    form = RopeForm(64, 10_000.0, 1.0)
    assert form.agrees()
    freqs = np.array(form.inv_freqs)
    freqs[5] = np.nextafter(freqs[5], np.float32(1.0))
    form.inv_freqs = mx.array(freqs)
    assert not form.agrees()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_then_weight_equals_fast_rms_norm(dtype):
    x = _rows((3, 4, 1, 64), dtype, seed=7)
    w = (1.0 + 0.5 * mx.random.normal((64,), key=mx.random.key(8))).astype(dtype)
    assert _equal(rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("x_dtype,w_dtype", [(mx.bfloat16, mx.float32),
                                             (mx.float32, mx.bfloat16),
                                             (mx.float16, mx.bfloat16)])
def test_rms_norm_in_the_promoted_dtype_equals_fast_rms_norm(x_dtype, w_dtype):
    x = _rows((2, 3, 1, 32), x_dtype, seed=9)
    w = (1.0 + mx.random.normal((32,), key=mx.random.key(10))).astype(w_dtype)
    assert _equal(rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", (mx.float32, mx.bfloat16))
def test_one_norm_over_q_and_k_heads_equals_each_with_its_own_weight(dtype):
    """q heads with q_norm's weight and k heads with k_norm's, normed as one stack."""
    q, k = _rows((2, 8, 1, 64), dtype, 11), _rows((2, 2, 1, 64), dtype, 12)
    wq = (1.0 + mx.random.normal((64,), key=mx.random.key(13))).astype(dtype)
    wk = (1.0 + mx.random.normal((64,), key=mx.random.key(14))).astype(dtype)
    weight = mx.concatenate([mx.broadcast_to(wq, (8, 64)), mx.broadcast_to(wk, (2, 64))])
    both = mx.compile(lambda x, w: rms_norm(x, w, 1e-6))(mx.concatenate([q, k], 1),
                                                          weight[:, None])
    assert _equal(both[:, :8], mx.fast.rms_norm(q, wq, 1e-6))
    assert _equal(both[:, 8:], mx.fast.rms_norm(k, wk, 1e-6))


# The EAR-TTS backbone step (GemmaStep) with and without the forms.


def test_the_cpu_backbone_step_uses_the_forms_and_equals_the_plain_backbone(
    tiny_model, tiny_start
):
    tts = tiny_model.tts_model.tts_model
    tts._backbone_step = None
    attn = [layer.self_attn for layer in tts.backbone.layers]
    assert {a.is_sliding for a in attn} == {True, False}  # local and global RoPEs
    assert all(getattr(a, "fused_qkv", None) is not None for a in attn)  # q and k as one
    for step, expected, got in backbone_steps(tiny_model, tiny_start):
        assert step._forms is not None
        assert len(set(step._forms)) == 2
        assert _equal(got, expected)


def test_the_step_computes_each_ropes_cosines_once(tiny_model, tiny_start):
    """One Cos and one Sin per distinct RoPE in a step's graph (the fallback has one
    per q and per k of every layer)."""
    tts = tiny_model.tts_model.tts_model
    tts._backbone_step = None
    fast = Timeline(tiny_model, tiny_start)
    text = mx.array([[7]], dtype=mx.int32)
    mx.eval(tts.backbone_step(fast.prev_codes, text, fast.tts_caches))  # first step traces
    graph = graph_primitives(tts.backbone_step(fast.prev_codes, text, fast.tts_caches))
    cos = sum(n for name, n in graph.items() if "Cos" in name)
    sin = sum(n for name, n in graph.items() if "Sin" in name)
    assert cos == sin == 2 < 2 * len(tts.backbone.layers)


def test_off_the_cpu_predicate_the_step_keeps_fast_rope_and_equals_the_plain_backbone(
    tiny_model, tiny_start, monkeypatch
):
    monkeypatch.setattr(fast_forms, "fast_ops_expand", lambda: False)
    tts = tiny_model.tts_model.tts_model
    tts._backbone_step = None
    try:
        for step, expected, got in backbone_steps(tiny_model, tiny_start):
            assert step._forms is None
            assert _equal(got, expected)
    finally:
        tts._backbone_step = None


def test_a_layer_whose_rope_has_no_form_keeps_every_layer_on_its_own_rope(
    tiny_model, monkeypatch
):
    tts = tiny_model.tts_model.tts_model
    attn = tts.backbone.layers[0].self_attn
    monkeypatch.setattr(attn, "rope", nn.RoPE(attn.rope.dims, traditional=True,
                                              base=attn.rope.base))
    assert GemmaStep(tts.backbone, tts._step_inputs)._forms is None
