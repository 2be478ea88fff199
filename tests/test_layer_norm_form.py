"""LayerNorm where mx.fast ops expand: the fast op's bits, one kernel fewer, the module unchanged."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_voicechat_plugin.models import fast_forms
from mlx_voicechat_plugin.models.fast_forms import (
    ExpandedLayerNorm, expand_layer_norms, fast_ops_expand, layer_norm)
from mlx_voicechat_plugin.instruments.kernels import graph_primitives, kernel_count

pytestmark = pytest.mark.skipif(not fast_ops_expand(), reason="the forms are the CPU fallback's")

DTYPES = [mx.float32, mx.bfloat16, mx.float16]


def _inputs(shape, dtype, scale, offset, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal(shape) * scale + offset).astype(dtype)


CASES = [  # shape, scale, offset, eps: one frame, batches, long rows, large offsets, tiny eps
    ((1, 1, 1024), 1.0, 0.0, 1e-5), ((2, 1, 176), 1e-3, 5.0, 1e-5), ((3, 5, 80), 100.0, -3.0, 1e-6),
    ((16, 1, 512), 1e4, 1e3, 1e-12), ((2, 33), 3.0, 1e2, 1e-5), ((4, 1), 1.0, 1.0, 1e-5)]
AFFINE = ["weight+bias", "weight", "bias", "none"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("x_dtype, w_dtype, affine", [
    *((x, None, a) for x in DTYPES for a in AFFINE),  # parameters of the input's dtype
    *((x, w, "weight+bias") for x in DTYPES for w in DTYPES if w != x),  # mixed: promotes
    (mx.bfloat16, mx.float32, "weight"), (mx.bfloat16, mx.float32, "bias")],
    ids=lambda v: str(v).replace("mlx.core.", ""))
def test_the_form_is_mx_fast_layer_norm_bit_for_bit(compiled, x_dtype, w_dtype, affine):
    """Every input dtype against every parameter dtype (float32 weights on bf16 inputs
    promote the result; a bias alone does not), with and without weight and bias,
    eager and compiled, over magnitudes where the centring cancels many bits."""
    for i, (shape, scale, offset, eps) in enumerate(CASES):
        dims = shape[-1]
        params = w_dtype or x_dtype
        x = _inputs(shape, x_dtype, scale, offset, seed=i)
        w = mx.random.normal((dims,)).astype(params) if "weight" in affine else None
        b = mx.random.normal((dims,)).astype(params) if "bias" in affine else None

        def form(x):
            return layer_norm(x, w, b, eps)

        def fast(x):
            return mx.fast.layer_norm(x, w, b, eps)

        if compiled:
            form, fast = mx.compile(form), mx.compile(fast)
        got, want = form(x), fast(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want, equal_nan=True), (shape, scale, offset, eps)


def test_compiled_it_launches_one_kernel_fewer_than_the_fallback():
    """Sum, the centred square, sum, the tail: ``x - mean`` is never written."""
    x, w, b = mx.random.normal((1, 1, 256)), mx.random.normal((256,)), mx.random.normal((256,))
    mx.eval(x, w, b)

    def kernels(norm):
        return kernel_count(graph_primitives(mx.compile(lambda x: norm(x, w, b, 1e-5))(x)))

    assert kernels(layer_norm) == kernels(mx.fast.layer_norm) - 1 == 4


def test_expanded_modules_keep_their_parameters_and_outputs():
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.LayerNorm(16, affine=False),
                          nn.LayerNorm(16, bias=False))
    mx.random.seed(1)
    model.update({"layers": [{}, {"weight": mx.random.normal((16,)),
                                  "bias": mx.random.normal((16,))}, {}, {}]})
    x = mx.random.normal((2, 3, 8))
    before, params = model(x), dict(model.parameters())
    assert expand_layer_norms(model) == 3
    assert expand_layer_norms(model) == 0  # idempotent
    assert all(type(m) is ExpandedLayerNorm for m in model.layers[1:])
    assert mx.array_equal(model(x), before)
    assert dict(model.parameters()).keys() == params.keys()
    model.update({"layers": [{}, {"weight": mx.ones((16,))}, {}, {}]})  # updates as before
    assert mx.array_equal(model.layers[1].weight, mx.ones((16,)))


def test_where_fast_ops_do_not_expand_the_module_calls_the_fast_op(monkeypatch):
    norm = nn.LayerNorm(32)
    expand_layer_norms(nn.Sequential(norm))
    calls = []
    monkeypatch.setattr(fast_forms, "layer_norm", lambda *a: calls.append(a))
    monkeypatch.setattr(fast_forms, "fast_ops_expand", lambda: False)
    x = mx.random.normal((1, 1, 32))
    mx.eval(norm(x))
    assert calls == []
    monkeypatch.setattr(fast_forms, "fast_ops_expand", lambda: True)
    norm(x)
    assert len(calls) == 1


def test_a_prepared_model_runs_the_form_in_its_conformer(tiny_model):
    layers = tiny_model.stt_model.perception.encoder.layers
    assert tiny_model.expanded_layer_norms >= 6 * len(layers)
    assert all(type(m) is not nn.LayerNorm for _, m in tiny_model.named_modules())


def _written_out(x, w, b, eps):
    """The codec's ChannelNorm as written: ``mx.mean`` and ``mx.var``."""
    mean = mx.mean(x, axis=-1, keepdims=True)
    var = mx.var(x, axis=-1, keepdims=True)
    return (x - mean) * mx.rsqrt(var + eps) * w + b


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("x_dtype, w_dtype", [
    *((x, x) for x in DTYPES), (mx.float32, mx.bfloat16), (mx.bfloat16, mx.float32)], ids=str)
def test_the_mean_var_form_is_the_written_out_norm_bit_for_bit(compiled, x_dtype, w_dtype):
    for i, (shape, scale, offset, eps) in enumerate(CASES):
        x = _inputs(shape, x_dtype, scale, offset, seed=i)
        w, b = (mx.random.normal((shape[-1],)).astype(w_dtype) for _ in range(2))

        def form(x):
            return fast_forms.mean_var_norm(x, w, b, eps)

        def plain(x):
            return _written_out(x, w, b, eps)

        if compiled:
            form, plain = mx.compile(form), mx.compile(plain)
        got, want = form(x), plain(x)
        assert got.dtype == want.dtype and mx.array_equal(got, want, equal_nan=True), shape
    ints = mx.zeros((1, 4), mx.int32)
    with pytest.raises(ValueError, match="floating input"):
        fast_forms.mean_var_norm(ints, ints[0], ints[0], 1e-6)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_the_mean_var_forms_count_reciprocal_is_rounded_as_means(dtype):
    """The one constant the form makes itself, at every row length up to 4096."""
    for n in range(1, 4097):
        one_hot = mx.concatenate([mx.ones((1,), dtype), mx.zeros((n - 1,), dtype)])
        assert mx.array_equal(mx.mean(one_hot), mx.array(1.0 / n, dtype)), n


def test_compiled_the_mean_var_form_launches_one_kernel_fewer():
    x, w, b = mx.random.normal((1, 1, 256)), mx.random.normal((256,)), mx.random.normal((256,))
    mx.eval(x, w, b)

    def kernels(norm):
        return kernel_count(graph_primitives(mx.compile(lambda x: norm(x, w, b, 1e-6))(x)))

    assert kernels(fast_forms.mean_var_norm) == kernels(_written_out) - 1 == 4


def test_the_codec_channel_norm_uses_the_form_only_where_fast_ops_expand(monkeypatch):
    from mlx_voicechat_plugin.models.codec import codec

    norm = codec.ChannelNorm(16)
    calls = []
    monkeypatch.setattr(codec, "mean_var_norm", lambda *a: calls.append(a))
    monkeypatch.setattr(codec, "fast_ops_expand", lambda: False)
    x = mx.random.normal((1, 3, 16))
    mx.eval(norm(x))
    mx.eval(norm(x.astype(mx.bfloat16)))
    assert calls == []
    monkeypatch.setattr(codec, "fast_ops_expand", lambda: True)
    norm(x)
    assert len(calls) == 1
