"""Fixture weights are written tensor by tensor: quantized, evaluated and sharded as drawn.

This is the path that lets the ``full`` fixture (21 GB of bfloat16 before
quantizing) build in about its on-disk size; here it runs at the ``small``
size, where the whole model also fits at once to compare against.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlx_voicechat_plugin.config import ModelConfig
from mlx_voicechat_plugin.testing.configs import fixture_config
from mlx_voicechat_plugin.testing.fixtures import (
    INDEX_FILE,
    WEIGHTS_FILE,
    make_checkpoint,
    quantize_weights,
)
from mlx_voicechat_plugin.testing.tokenizers import build_text_tokenizer
from mlx_voicechat_plugin.testing.weights import TUNINGS, build_weights


def _all_at_once(size: str, bits: int | None) -> dict[str, mx.array]:
    """Every tensor drawn, then quantized, then evaluated: the path the writer replaced."""
    config = ModelConfig.from_dict(fixture_config(size))
    vocab = build_text_tokenizer(config.text_config.vocab_size, config.bos_token_id,
                                 config.eos_token_id, config.silence_token_id,
                                 config.pad_token_id).vocab
    weights = build_weights(config, vocab, tuning=TUNINGS.get(size))
    return quantize_weights(weights, bits) if bits else weights


@pytest.mark.parametrize("bits", [None, 4])
def test_per_tensor_shard_is_byte_identical_to_the_whole_model_at_once(tmp_path, bits):
    ckpt = make_checkpoint(tmp_path / "ckpt", "small", quantize_bits=bits)
    whole = _all_at_once("small", bits)
    mx.eval(whole)
    mx.save_safetensors(str(tmp_path / "whole.safetensors"), whole, metadata={"format": "mlx"})
    assert (ckpt / WEIGHTS_FILE).read_bytes() == (tmp_path / "whole.safetensors").read_bytes()


def test_shards_are_cut_as_they_fill_and_named_as_mlx_lm_names_them(tmp_path):
    one = make_checkpoint(tmp_path / "one", "small", quantize_bits=4)
    many = make_checkpoint(tmp_path / "many", "small", quantize_bits=4,
                           max_shard_bytes=1 << 20)
    index = json.loads((many / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                      for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in many.glob("*.safetensors")) == shards
    assert not list(many.glob(".shard-*"))  # every partial name was given its final one
    split: dict[str, mx.array] = {}
    for shard in shards:
        part = mx.load(str(many / shard))
        assert set(part) == {k for k, v in index["weight_map"].items() if v == shard}
        split.update(part)
    whole = mx.load(str(one / WEIGHTS_FILE))
    assert set(split) == set(whole)
    assert all(mx.array_equal(split[k], whole[k]) for k in whole)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in whole.values())


def test_reference_and_plugin_load_a_sharded_fixture_strictly(tmp_path):
    from mlx_vlm.utils import load as reference_load

    from mlx_voicechat_plugin.loader import load

    ckpt = make_checkpoint(tmp_path / "many", "small", quantize_bits=4,
                           max_shard_bytes=1 << 20)
    model, _ = reference_load(str(ckpt))
    assert model.stt_model.lm_head.bits == 4
    ours, _ = load(ckpt)
    assert ours.config.text_config.vocab_size == model.config.text_config.vocab_size
