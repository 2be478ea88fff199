"""The ``full`` fixture size: the released 11B's shapes, built on a GPU, never here.

Building it takes 10.7 GiB, so these tests read its configuration only (key
shapes, the layer pattern, the parameter count from the shapes of a model
that is constructed but never evaluated) and check the device-drawn weight
path and the filled tokenizer at small sizes, where they are cheap.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_voicechat_plugin.config import ModelConfig
from mlx_voicechat_plugin.testing.configs import (
    DRAWN_ON_DEVICE,
    FULL_QUANTIZE_BITS,
    RELEASED_PATTERN,
    fixture_config,
)
from mlx_voicechat_plugin.testing.fixtures import QUANTIZATION_GROUP_SIZE, is_quantized_module
from mlx_voicechat_plugin.testing.weights import build_weights

FULL = ModelConfig.from_dict(fixture_config("full"))


def test_full_language_model_has_the_released_shapes():
    text = FULL.text_config
    assert len(RELEASED_PATTERN) == 56 and text.hybrid_override_pattern == RELEASED_PATTERN
    assert RELEASED_PATTERN.count("M") == 27 and RELEASED_PATTERN.count("*") == 4
    assert (text.hidden_size, text.num_hidden_layers) == (4480, 56)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (40, 8, 128)
    assert (text.mamba_num_heads, text.mamba_head_dim) == (128, 80)
    assert (text.ssm_state_size, text.n_groups) == (128, 8)
    assert (text.vocab_size, text.intermediate_size) == (131_072, 15_680)
    assert FULL_QUANTIZE_BITS == 4 and QUANTIZATION_GROUP_SIZE == 64
    assert "full" in DRAWN_ON_DEVICE


def test_full_speech_stages_have_the_released_shapes():
    audio, tts, codec = FULL.audio_config, FULL.tts_config, FULL.codec_config
    encoder = audio.encoder
    assert (encoder.n_layers, encoder.d_model, encoder.n_heads) == (24, 1024, 8)
    assert encoder.subsampling_conv_channels == 256 and audio.output_dim == 4480
    assert (audio.decoder.pred_hidden, audio.joint.joint_hidden) == (640, 640)
    assert audio.decoder.vocab_size == audio.joint.num_classes == 1024 == FULL.rnnt_blank_id
    assert (tts.num_hidden_layers, tts.hidden_size, tts.num_attention_heads, tts.head_dim) == \
        (28, 1152, 16, 72)
    assert (tts.intermediate_size, tts.latent_size) == (4608, 512)
    mog = tts.mog_head
    assert (mog.intermediate_size, mog.num_predictions, mog.low_rank) == (4608, 1024, 64)
    assert (codec.base_channels, codec.blocks_per_stage, codec.latent_dim) == (384, 3, 512)
    assert codec.samples_per_frame == 1764


def test_full_parameter_count_from_its_shapes_is_the_11b():
    from mlx_voicechat_plugin.models.model import Model

    model = Model(FULL)  # parameters are lazy: nothing is drawn or allocated
    params = dict(tree_flatten(model.parameters()))
    total = sum(v.size for v in params.values())
    quantized = sum(v.size for k, v in params.items()
                    if k.endswith(".weight") and is_quantized_module(k.rsplit(".", 1)[0]))
    text = FULL.text_config
    h, v = text.hidden_size, text.vocab_size
    inner = text.mamba_num_heads * text.mamba_head_dim
    conv = inner + 2 * text.n_groups * text.ssm_state_size
    per_block = {
        "M": h * (inner + conv + text.mamba_num_heads) + inner * h,
        "*": h * (text.num_attention_heads + 2 * text.num_key_value_heads) * text.head_dim
        + text.num_attention_heads * text.head_dim * h,
        "-": 2 * h * text.intermediate_size,
    }
    by_shapes = 3 * v * h + sum(per_block[b] for b in RELEASED_PATTERN)
    assert quantized == by_shapes
    assert 9.4e9 < quantized < 9.5e9 and 11.0e9 < total < 11.2e9


def test_device_drawn_weights_have_the_host_layout():
    config = ModelConfig.from_dict(fixture_config("tiny"))
    from mlx_voicechat_plugin.testing.tokenizers import build_text_tokenizer

    vocab = build_text_tokenizer(config.text_config.vocab_size, config.bos_token_id,
                                 config.eos_token_id, config.silence_token_id,
                                 config.pad_token_id).vocab
    host = build_weights(config, vocab)
    drawn = build_weights(config, vocab, device=True)
    assert {k: (v.shape, v.dtype) for k, v in host.items()} == \
        {k: (v.shape, v.dtype) for k, v in drawn.items()}
    embed = drawn["stt_model.embed_tokens.weight"].astype(mx.float32)
    assert bool(mx.isfinite(embed).all()) and float(embed.std()) > 0.0
    again = build_weights(config, vocab, device=True)
    assert all(mx.array_equal(drawn[k], again[k]) for k in drawn)  # keyed by name and seed


def test_a_filled_tokenizer_reaches_a_vocabulary_the_corpus_cannot():
    from mlx_voicechat_plugin.testing.tokenizers import BOS_TOKEN, build_text_tokenizer

    files = build_text_tokenizer(4096, 1, 2, 11, 12, fill=True)
    assert len(files.vocab) == 4096 and sorted(files.vocab.values()) == list(range(4096))
    assert files.vocab[BOS_TOKEN] == 1
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(files.tokenizer_json)
    assert tokenizer.get_vocab_size() == 4096
    assert tokenizer.decode([4095]).strip().startswith("q")
