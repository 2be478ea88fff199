"""Matrix products by shape (instruments/matmuls.py): the rows a CUDA backend would see.

Known products give known counts: one row is not wide, two are; a 3-D left
operand against a matrix folds its leading dimensions into the rows; a
batched one-row product is not wide; quantized products are wide past one
row. A planted extra wide product moves the count by one; other threads are
not counted; nothing stays patched. One pool step of the tiny fixture shows
the CFG rows of the TTS backbone and the MoG head as wide.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_voicechat_plugin.runtime import compile_policy
from mlx_voicechat_plugin.instruments.matmuls import MatmulShapes, float_rows

K, N = 64, 32


def _ones(*shape: int) -> mx.array:
    return mx.ones(shape)


@pytest.mark.parametrize("a, b, rows, wide", [
    ((1, K), (K, N), 1, False),
    ((2, K), (K, N), 2, True),
    ((2, 1, K), (K, N), 2, True),  # leading dims fold into the rows against a matrix
    ((4, 1, 16), (4, 16, 8), 1, False),  # one row per batch entry: gemv
    ((3, 5, 16), (3, 16, 8), 5, True),
    ((2, K), (K, 1), 2, False),  # one column: gemv
    ((K,), (K, N), 1, False),
])
def test_a_known_product_has_its_known_rows(a, b, rows, wide):
    with MatmulShapes() as shapes:
        _ones(*a) @ _ones(*b)
    (product,) = shapes.products
    assert (product.rows, product.wide, product.kind) == (rows, wide, "float")
    assert float_rows(a, b) == rows
    assert shapes.summary()["wide_float"] == int(wide)


def test_every_entry_point_is_recorded():
    w, scales, biases = mx.quantize(mx.random.normal((N, K)), group_size=32, bits=4)
    with MatmulShapes() as shapes:
        mx.matmul(_ones(2, K), _ones(K, N))
        mx.addmm(_ones(N), _ones(1, K), _ones(K, N))
        mx.quantized_matmul(_ones(1, K), w, scales, biases, group_size=32, bits=4)
        mx.quantized_matmul(_ones(2, K), w, scales, biases, group_size=32, bits=4)
        mx.gather_mm(_ones(3, 1, K), _ones(3, K, N))
    ops = [(p.op, p.kind, p.rows, p.wide) for p in shapes.products]
    assert ops == [("matmul", "float", 2, True), ("addmm", "float", 1, False),
                   ("quantized_matmul", "quantized", 1, False),
                   ("quantized_matmul", "quantized", 2, True),
                   ("gather_mm", "float", 1, False)]
    summary = shapes.summary()
    assert (summary["products"], summary["wide_float"], summary["wide_quantized"],
            summary["addmm"]) == (5, 1, 1, 1)


def test_layers_are_counted_and_labelled_by_their_caller():
    linear = nn.Linear(K, N)
    quantized = nn.QuantizedLinear(K, N)

    def two_rows() -> None:
        linear(_ones(2, K))  # addmm inside mlx.nn
        quantized(_ones(2, K))

    with MatmulShapes() as shapes:
        two_rows()
    assert [(p.kind, p.dtype, p.rows, p.wide) for p in shapes.products] == \
        [("float", "float32", 2, True), ("quantized", "float32", 2, True)]
    assert {p.caller for p in shapes.products} == {"other"}  # not called from the packages


@pytest.mark.parametrize("extra", [False, True])
def test_a_planted_wide_product_moves_the_count_by_one(extra):
    with MatmulShapes() as shapes:
        _ones(1, K) @ _ones(K, N)
        _ones(2, K) @ _ones(K, N)
        if extra:
            _ones(2, 1, K) @ _ones(K, N)  # the planted one: two rows once folded
    # Fails (by design) when the planted product is not seen as wide.
    assert shapes.summary()["wide_float"] == 1 + int(extra)
    assert shapes.summary()["products"] == 2 + int(extra)


def test_other_threads_are_not_counted_and_nothing_stays_patched():
    originals = (mx.matmul, mx.addmm, mx.array.__matmul__, mx.quantized_matmul, mx.gather_mm)
    with MatmulShapes() as shapes:
        worker = threading.Thread(target=lambda: _ones(2, K) @ _ones(K, N))
        worker.start()
        worker.join()
        with pytest.raises(RuntimeError):
            MatmulShapes().__enter__()
        assert mx.matmul is not originals[0]
    assert shapes.products == []
    assert (mx.matmul, mx.addmm, mx.array.__matmul__, mx.quantized_matmul,
            mx.gather_mm) == originals
    _ones(2, K) @ _ones(K, N)
    assert shapes.products == []


def test_compiled_products_show_only_with_compile_suspended():
    was = compile_policy.enabled()
    compile_policy.apply(True, long_running=True)
    try:
        product = mx.compile(lambda a, b: mx.tanh(a @ b))
        a, b = _ones(2, K), _ones(K, N)
        mx.eval(product(a, b))  # traced once, outside any count
        with MatmulShapes() as shapes:
            mx.eval(product(a, b))  # replays the trace: no Python, nothing seen
        assert shapes.products == []
        with compile_policy.suspended(), MatmulShapes() as shapes:
            assert not compile_policy.enabled()
            mx.eval(product(a, b))
        assert [p.rows for p in shapes.products] == [2]
        assert compile_policy.enabled()
    finally:
        compile_policy.apply(was, long_running=True)


@pytest.mark.parametrize("before", [True, False])
def test_suspending_compile_restores_the_state_it_found(before):
    was = compile_policy.enabled()
    compile_policy.apply(before, long_running=True)
    try:
        with pytest.raises(KeyError):
            with compile_policy.suspended():
                assert not compile_policy.enabled()
                raise KeyError("restored even on an error")
        assert compile_policy.enabled() is before
    finally:
        compile_policy.apply(was, long_running=True)


def test_a_pool_step_shows_the_cfg_rows_as_wide(tiny_ckpt):
    from bench.kernels import count_steps
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    one = count_steps(model.create_session(processor), 1, warm_frames=8, frames=1)
    shapes = one["product_shapes"]
    assert one["products"] > 0 and one["wide_float"] > 0
    # One session: the TTS backbone and the MoG head run [cond; uncond], two rows.
    assert shapes["wide_rows"].get(2, 0) > 0, shapes
    callers = " ".join(one["wide_callers"])
    assert "gemma_step" in callers and "mog_head" in callers, callers
