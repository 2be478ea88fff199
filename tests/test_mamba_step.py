"""One Mamba2 position through MambaStep is the upstream block's position, bit for bit.

MambaStep (models/language/mamba_step.py) replaces, off Metal, upstream's chunked scan at
one position by the ops that survive at length one. It must return exactly what
``NemotronHBlock(x, mask=None, cache=...)`` returns, hidden state and both cache
arrays, for any batch, dtype, grouping of B/C and state history, eager and
compiled (the LLM runs it inside ``mx.compile``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_vlm.models.cache import ArraysCache
from mlx_vlm.models.nemotron_h.config import ModelConfig
from mlx_vlm.models.nemotron_h.language import NemotronHBlock

from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.models.language.mamba_step import MambaStep, use_upstream
from mlx_voicechat_plugin.models.segments import SegmentedStep
from mlx_voicechat_plugin.testing.configs import CONFIGS, _text_config

STEPS = 5

# (hidden, mamba heads, head dim, state size, groups)
SHAPES = {
    "tiny": (64, 4, 16, 16, 2),
    "medium": (768, 48, 16, 16, 2),
    "one group": (64, 4, 16, 16, 1),
    "three groups": (96, 6, 16, 16, 3),
    "wide state": (128, 8, 16, 32, 4),
    # The released mixer's heads, head dim, state and groups, on a narrow residual.
    "full mixer": (128, 128, 80, 128, 8),
}


def _block(hidden: int, heads: int, head_dim: int, state: int, groups: int,
           dtype: mx.Dtype, seed: int = 0) -> NemotronHBlock:
    config = ModelConfig.from_dict(_text_config(
        hidden, "M", heads=4, kv_heads=2, mamba_heads=heads, mamba_head_dim=head_dim,
        ssm_state=state, groups=groups))
    block = NemotronHBlock(config, "M")
    keys = iter(mx.random.split(mx.random.key(seed), 64))
    block.update(nn.utils.tree_map(
        lambda p: (0.2 * mx.random.normal(p.shape, key=next(keys))).astype(dtype),
        block.parameters()))
    mixer = block.mixer
    # A spread of decays and step sizes, A_log in float32 as checkpoints store it.
    mixer.A_log = mx.log(mx.arange(1, heads + 1, dtype=mx.float32)) + 0.3 * mx.random.normal(
        (heads,), key=next(keys))
    mixer.dt_bias = (mx.random.normal((heads,), key=next(keys)) - 2).astype(dtype)
    return block


def _upstream(block):
    def step(x, conv, ssm):
        cache = ArraysCache(size=2)
        cache[0], cache[1] = conv, ssm
        y = block(x, mask=None, cache=cache)
        return y, cache[0], cache[1]
    return step


def _same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b))


def _as_rows(step):
    """``step`` fed one position's ``(B, hidden)`` rows, its hidden state back as ``(B, 1, hidden)``."""
    def rows(x, conv, ssm):
        y, conv, ssm = step(x[:, 0], conv, ssm)
        return y[:, None], conv, ssm
    return rows


def _assert_steps_equal(block, batch: int, compiled: bool, seed: int, rows: bool = False) -> None:
    hidden = block.norm.weight.shape[0]
    dtype = block.norm.weight.dtype
    expected_fn, got_fn = _upstream(block), MambaStep(block)
    if rows:
        got_fn = _as_rows(got_fn)
    if compiled:
        expected_fn, got_fn = mx.compile(expected_fn), mx.compile(got_fn)
    keys = iter(mx.random.split(mx.random.key(seed), STEPS + 1))
    prefill = ArraysCache(size=2)
    block(mx.random.normal((batch, 5, hidden), key=next(keys)).astype(dtype), cache=prefill)
    expected = got = (prefill[0], prefill[1])
    for t in range(STEPS):
        x = mx.random.normal((batch, 1, hidden), key=next(keys)).astype(dtype)
        want = expected_fn(x, *expected)
        have = got_fn(x, *got)
        for name, a, b in zip(("hidden", "conv state", "ssm state"), want, have):
            assert _same(a, b), f"step {t}: {name} differs"
        expected, got = want[1:], have[1:]


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_step_equals_the_upstream_block_compiled(shape, dtype):
    block = _block(*SHAPES[shape], dtype)
    _assert_steps_equal(block, batch=3, compiled=True, seed=1)
    _assert_steps_equal(block, batch=1, compiled=True, seed=2)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_step_on_rows_equals_the_upstream_block(dtype):
    """The LLM's runs carry one position as (B, hidden) rows: the same bits."""
    block = _block(*SHAPES["three groups"], dtype)
    _assert_steps_equal(block, batch=3, compiled=True, seed=7, rows=True)
    _assert_steps_equal(block, batch=1, compiled=False, seed=8, rows=True)


@pytest.mark.parametrize("shape", ["tiny", "three groups"])
def test_step_equals_the_upstream_block_eager(shape):
    _assert_steps_equal(_block(*SHAPES[shape], mx.bfloat16), batch=2, compiled=False, seed=3)


def test_step_equals_the_upstream_block_quantized():
    block = _block(*SHAPES["three groups"], mx.bfloat16)
    nn.quantize(block, group_size=32, bits=4)
    _assert_steps_equal(block, batch=2, compiled=True, seed=4)


def test_step_equals_the_upstream_block_with_a_padded_projection():
    """Checkpoints may pad in_proj in front with two unused branches of equal width."""
    block = _block(*SHAPES["three groups"], mx.bfloat16)
    linear = block.mixer.in_proj
    width, hidden = linear.weight.shape
    padded = nn.Linear(hidden, width + 2 * 8, bias=False)
    padded.weight = (0.2 * mx.random.normal(padded.weight.shape, key=mx.random.key(5))
                     ).astype(mx.bfloat16)
    block.mixer.in_proj = padded
    _assert_steps_equal(block, batch=2, compiled=True, seed=6)


def test_the_shape_table_holds_the_fixtures_mixers():
    for name in ("tiny", "medium"):
        text = CONFIGS[name]["text_config"]
        assert SHAPES[name] == (text["hidden_size"], text["mamba_num_heads"],
                                text["mamba_head_dim"], text["ssm_state_size"], text["n_groups"])


@pytest.fixture(scope="module")
def tiny_q4_llm(tiny_q4_ckpt):
    model, _ = load(tiny_q4_ckpt)
    return model.stt_model.llm


def test_step_equals_the_fixture_checkpoints_mamba_layers(tiny_q4_llm):
    blocks = [layer for layer in tiny_q4_llm.layers if layer.block_type == "M"]
    assert blocks
    for i, block in enumerate(blocks):
        _assert_steps_equal(block, batch=2, compiled=True, seed=10 + i)


def test_the_segmented_llm_step_runs_mamba_step_off_metal(tiny_q4_llm):
    assert not use_upstream()  # this suite runs on MLX's CPU backend
    step = SegmentedStep(tiny_q4_llm.layers, lambda x: (x,))
    runs = [part for part in step.plan if hasattr(part, "steps")]
    mamba = [s for run in runs for s, slot in zip(run.steps, run.cache_index) if slot is not None]
    assert mamba and all(isinstance(s, MambaStep) for s in mamba)
