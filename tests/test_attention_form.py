"""Attention where mx.fast ops expand: the scale multiply inside the caller's kernel, the same bits."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_audio.stt.models.nemotron_asr.attention import RelPositionMultiHeadAttention

from mlx_voicechat_plugin.models.perception import encoder_stream
from mlx_voicechat_plugin.models.fast_forms import attention_prescaled, fast_ops_expand
from mlx_voicechat_plugin.instruments.kernels import graph_primitives, kernel_count

pytestmark = pytest.mark.skipif(not fast_ops_expand(), reason="the forms are the CPU fallback's")

DTYPES = [mx.float32, mx.bfloat16, mx.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, heads, queries, keys, dims", [
    (1, 4, 1, 71, 64), (3, 2, 1, 1, 32), (16, 8, 1, 17, 128), (2, 4, 5, 9, 16)])
def test_prescaled_attention_is_the_fast_op_bit_for_bit(dtype, batch, heads, queries, keys, dims):
    mx.random.seed(keys)
    q = (mx.random.normal((batch, heads, queries, dims)) * 3).astype(dtype)
    k, v = (mx.random.normal((batch, heads, keys, dims)).astype(dtype) for _ in range(2))
    mask = (mx.random.normal((batch, heads, queries, keys)) * 2).astype(dtype)
    scale = dims**-0.5
    for compile_ in (lambda f: f, mx.compile):
        want = compile_(lambda q, k, v, m: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=m))(q, k, v, mask)
        got = compile_(lambda q, k, v, m: attention_prescaled(
            q * mx.array(scale, dtype), k, v, m))(q, k, v, mask)
        assert got.dtype == want.dtype and mx.array_equal(got, want)


def test_it_refuses_what_it_does_not_compute():
    q, k = mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, 3, 8))
    with pytest.raises(ValueError, match="one key head per query head"):
        attention_prescaled(q, k, k, mx.zeros((1, 4, 1, 3)))
    with pytest.raises(ValueError, match="additive mask"):
        attention_prescaled(q, q, q, mx.zeros((1, 4, 1, 1), mx.bool_))


def _conformer_attention(dtype, dims=64, heads=4):
    attn = RelPositionMultiHeadAttention(heads, dims)
    attn.pos_bias_u = mx.random.normal((heads, dims // heads))
    attn.pos_bias_v = mx.random.normal((heads, dims // heads))
    attn.set_dtype(dtype)
    return attn


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, window", [(1, 71), (3, 1), (16, 17)])
def test_a_one_frame_conformer_attention_gives_the_fast_ops_bits_one_kernel_fewer(
        monkeypatch, dtype, batch, window):
    mx.random.seed(window)
    attn = _conformer_attention(dtype)
    q = (mx.random.normal((batch, 1, 64)) * 3).astype(dtype)
    k, v = (mx.random.normal((batch, window, 64)).astype(dtype) for _ in range(2))
    p = mx.random.normal((1, 2 * window - 1, 64)).astype(dtype)
    mx.eval(attn.parameters(), q, k, v, p)

    def run(expand: bool) -> mx.array:
        monkeypatch.setattr(encoder_stream, "fast_ops_expand", lambda: expand)
        return mx.compile(lambda q, k, v, p: encoder_stream._attend_kv(attn, None, k, v, p, q=q))(
            q, k, v, p)

    plain, expanded = run(False), run(True)
    kernels = [kernel_count(graph_primitives(out)) for out in (plain, expanded)]
    assert mx.array_equal(plain, expanded)
    assert kernels[1] == kernels[0] - 1


def test_where_fast_ops_do_not_expand_the_conformer_calls_the_fast_op(monkeypatch):
    attn = _conformer_attention(mx.float32)
    calls = []
    monkeypatch.setattr(encoder_stream, "fast_ops_expand", lambda: False)
    monkeypatch.setattr(encoder_stream, "attention_prescaled", lambda *a: calls.append(a))
    x, window = mx.random.normal((1, 1, 64)), mx.random.normal((1, 5, 64))
    mx.eval(encoder_stream._attend_kv(attn, x, attn.linear_k(window), attn.linear_v(window),
                                      mx.random.normal((1, 9, 64))))
    assert calls == []
