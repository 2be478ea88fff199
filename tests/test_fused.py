"""Projections of one input as one product: the same bits, one launch, the weights held once."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_voicechat_plugin.models import fused as fused_module
from mlx_voicechat_plugin.models.fused import fuse, fuse_projections, gated_mlp, project
from mlx_voicechat_plugin.models.speech.layers import GatedMLP
from mlx_voicechat_plugin.models.weight_layout import relayout
from mlx_voicechat_plugin.instruments.kernels import graph_primitives


class Attention(nn.Module):
    def __init__(self, dims: int = 64, heads: int = 4, kv_heads: int = 2, head: int = 16,
                 bias: bool = False):
        super().__init__()
        self.q_proj = nn.Linear(dims, heads * head, bias=bias)
        self.k_proj = nn.Linear(dims, kv_heads * head, bias=bias)
        self.v_proj = nn.Linear(dims, kv_heads * head, bias=bias)


def _outputs(block: Attention, x: mx.array) -> list[mx.array]:
    return [block.q_proj(x), block.k_proj(x), block.v_proj(x)]


@pytest.mark.parametrize("kind", ["float32", "relaid", "relaid-biased", "bfloat16", "q4"])
def test_a_fused_product_gives_each_projections_bits(kind):
    mx.random.seed(3)
    block = Attention(bias="biased" in kind)
    if kind.startswith("relaid"):
        relayout(block)
    elif kind == "bfloat16":
        block.set_dtype(mx.bfloat16)
    elif kind == "q4":
        nn.quantize(block, group_size=32, bits=4)
    x = mx.random.normal((3, 1, 64)).astype(mx.bfloat16 if kind == "bfloat16" else mx.float32)
    apart = _outputs(block, x)
    assert fuse_projections([block]) == 1
    together = project(block, "fused_qkv", (block.q_proj, block.k_proj, block.v_proj), x)
    for a, b in zip(apart, together):
        assert mx.array_equal(a, b)
    for a, b in zip(apart, _outputs(block, x)):  # the modules alone, over views
        assert mx.array_equal(a, b)
    primitives = graph_primitives(
        project(block, "fused_qkv", (block.q_proj, block.k_proj, block.v_proj), x))
    assert sum(primitives.get(k, 0) for k in ("Matmul", "AddMM", "QuantizedMatmul")) == 1


def test_a_stack_whose_product_differs_here_is_kept_apart():
    """A biased float32 nn.Linear is one addmm; on MLX's CPU backend a wider addmm's
    columns differ from the separate ones, and the probe sees it (weight_layout turns
    such layers into RowMajorLinear, which stacks)."""
    mx.random.seed(3)
    block = Attention(bias=True)
    x = mx.random.normal((3, 1, 64))
    apart = _outputs(block, x)
    if fuse_projections([block]):
        together = project(block, "fused_qkv", (block.q_proj, block.k_proj, block.v_proj), x)
        assert all(mx.array_equal(a, b) for a, b in zip(apart, together))
    else:
        assert getattr(block, "fused_qkv", None) is None
    assert all(mx.array_equal(a, b) for a, b in zip(apart, _outputs(block, x)))


def test_the_modules_weights_become_views_of_the_stack():
    block = Attention()
    weights = [m.weight for m in (block.q_proj, block.k_proj, block.v_proj)]
    fused = fuse([block.q_proj, block.k_proj, block.v_proj])
    assert fused is not None and fused.sizes == (64, 32, 32)
    stacked = fused.layer.weight
    assert mx.array_equal(stacked, mx.concatenate(weights))
    for module, weight in zip((block.q_proj, block.k_proj, block.v_proj), weights):
        assert mx.array_equal(module.weight, weight)


def test_a_replaced_module_falls_back_to_the_modules():
    block = Attention()
    fuse_projections([block])
    x = mx.random.normal((1, 64))
    nn.quantize(block, group_size=32, bits=4)  # replaced modules
    modules = (block.q_proj, block.k_proj, block.v_proj)
    assert not block.fused_qkv.serves(modules)
    for a, b in zip(project(block, "fused_qkv", modules, x), _outputs(block, x)):
        assert mx.array_equal(a, b)


def test_updated_weights_forget_the_stacks(tiny_model):
    model = tiny_model
    layer = model.tts_model.tts_model.backbone.layers[0]
    assert layer.self_attn.fused_qkv is not None
    model.update(model.parameters())  # what load_weights does
    assert layer.self_attn.fused_qkv is None and layer.mlp.fused_gate_up is None
    model.fused_blocks = fuse_projections(model._projection_blocks())  # as prepare does
    assert layer.self_attn.fused_qkv is not None


def test_a_compiled_trace_with_the_modules_state_keeps_the_stack_in_use():
    """mx.compile(inputs=state) hands the arrays back as new objects after a trace."""
    mlp = GatedMLP(32, 96)
    fuse_projections([mlp])
    x = mx.random.normal((2, 32))
    mx.compile(lambda x: mlp(x), inputs=mlp.state)(x)
    assert mlp.fused_gate_up.serves((mlp.gate_proj, mlp.up_proj))
    assert graph_primitives(mlp(x)).get("Matmul") == 2


def test_a_device_whose_stacked_product_differs_keeps_them_apart(monkeypatch):
    monkeypatch.setattr(fused_module, "_agrees", lambda fused, modules: False)
    block = Attention()
    weights = [m.weight for m in (block.q_proj, block.k_proj, block.v_proj)]
    assert fuse_projections([block]) == 0 and getattr(block, "fused_qkv", None) is None
    assert all(m.weight is w for m, w in zip((block.q_proj, block.k_proj, block.v_proj), weights))


def test_a_gated_mlp_fuses_gate_and_up():
    mx.random.seed(5)
    mlp = GatedMLP(32, 96)
    x = mx.random.normal((2, 32))
    before = mlp(x)
    assert fuse_projections([mlp]) == 1
    assert mx.array_equal(gated_mlp(mlp, x), before) and mx.array_equal(mlp(x), before)
    assert graph_primitives(mlp(x)).get("Matmul") == 2  # gate/up, then down


def test_load_fuses_the_blocks_the_one_position_steps_read(tiny_model):
    model = tiny_model
    tts = model.tts_model.tts_model
    expected = (2 * len(tts.backbone.layers)
                + len(model.stt_model.perception.encoder.layers)
                + sum(1 for layer in model.layers if layer.block_type == "*")
                + len(tts.mog_head.mlp_stack) - 1
                + 1)  # the MoG head's output heads
    assert model.fused_blocks == expected
    assert tts.mog_head.fused_heads is not None
    assert all(hasattr(layer.self_attn, "fused_qkv") and hasattr(layer.mlp, "fused_gate_up")
               for layer in tts.backbone.layers)


def test_a_block_without_projections_is_refused_by_name():
    with pytest.raises(TypeError, match="Linear has no projections"):
        fuse_projections([nn.Linear(2, 2)])


def test_the_mog_heads_three_products_are_one_and_sample_the_same_latent():
    from mlx_voicechat_plugin.config import MoGConfig
    from mlx_voicechat_plugin.models.speech.mog_head import MoGHead

    mx.random.seed(3)
    head = MoGHead(32, 16, MoGConfig(intermediate_size=48, num_predictions=12, low_rank=4,
                                     num_layers=1))
    head.low_mat = mx.random.normal(head.low_mat.shape)
    x = mx.random.normal((4, 1, 32))
    key = mx.random.key(5)
    def matmuls() -> int:
        return graph_primitives(*head(x, key=key)).get("Matmul", 0)

    before, apart = head(x, guidance_scale=1.5, top_p=0.9, key=key), matmuls()
    assert fuse_projections([head]) == 1
    after = head(x, guidance_scale=1.5, top_p=0.9, key=key)
    assert all(mx.array_equal(a, b) for a, b in zip(before, after))
    assert matmuls() == apart - 2  # logits, log-std and shared part in one product
