"""EAR-TTS networks equal the reference on the same random weights.

Both models load one bf16, checkpoint-like tensor dict (strict). Sampling
parity is exact: under the same seed the same codes come out, so the random
draws must be the same in number, order, shape and dtype.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_vlm.models.nemotron_voicechat import config as ref_config
from mlx_vlm.models.nemotron_voicechat import tts as ref_tts

from mlx_voicechat_plugin.config import TTSConfig
from mlx_voicechat_plugin.models.speech.ear_tts import EarTTS
from mlx_voicechat_plugin.models.speech.rvq import (
    codebook_norms,
    distance_in_one_product,
    rvq_assign,
    unmasking_schedule,
)
from mlx_voicechat_plugin.models.speech.mog_head import top_p_mask
from mlx_voicechat_plugin.instruments.kernels import graph_primitives
from mlx_voicechat_plugin.testing.configs import fixture_config

LAYOUT = Path(__file__).parent / "data" / "checkpoint_layout_tiny.txt"
PAD_ID = 12
STEPS = 5


def _max_abs(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))))


def _tts_dict() -> dict:
    return fixture_config("tiny")["tts_config"]


def _fake_vocab() -> dict[str, int]:
    """256 single characters (ids shuffled) plus multi-character tokens."""
    rng = np.random.default_rng(0)
    singles = [chr(0x20 + i) if i < 95 else chr(0x100 + i) for i in range(256)]
    ids = rng.permutation(np.arange(300, 300 + 256)).tolist()
    vocab = dict(zip(singles, ids))
    vocab.update({"<pad>": PAD_ID, "<s>": 1, "</s>": 2})
    words = ["▁hello", "lo", "▁world", "ab", "xyz", "▁the", "ing", "▁a\u0101"]
    vocab.update({w: 1000 + i for i, w in enumerate(words)})
    return vocab


VOCAB = _fake_vocab()
WORD_IDS = [VOCAB[w] for w in ("▁hello", "lo", "▁world", "xyz", "▁the", "ing")]


def _random_weights(model: EarTTS, seed: int = 0) -> dict[str, mx.array]:
    """A bf16 tensor for every parameter; int flag tables as stored (int64)."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, value in tree_flatten(model.parameters()):
        shape = tuple(value.shape)
        if key.endswith("is_continuation"):
            out[key] = mx.array(rng.integers(0, 2, shape), mx.int64)
        elif key.endswith("special_flags"):
            out[key] = mx.array(rng.integers(0, 3, shape), mx.int64)
        elif key.endswith("pad_tensor"):
            out[key] = value.astype(mx.int64)
        else:
            std = 1.0 if key in ("rvq_embs", "mog_head.low_mat") else 0.05
            out[key] = mx.array(rng.standard_normal(shape) * std).astype(mx.bfloat16)
    return out


def _pair(float32_backbone: bool = False):
    ours = EarTTS(TTSConfig.from_dict(_tts_dict()))
    ref = ref_tts.RVQEARTTSModel(ref_config.TTSConfig.from_dict(_tts_dict()))
    weights = _random_weights(ours)
    if float32_backbone:
        weights = {
            k: v.astype(mx.float32) if k.startswith(("backbone.", "mog_head.")) else v
            for k, v in weights.items()
        }
    for model in (ours, ref):
        model.load_weights(list(weights.items()), strict=True)
        model.set_vocabulary(VOCAB)
    mx.eval(ours.parameters(), ref.parameters())
    return ours, ref


@pytest.fixture(scope="module")
def pair():
    return _pair()


@pytest.fixture(scope="module")
def pair_f32():
    return _pair(float32_backbone=True)


def _prompt(config: TTSConfig, seed: int = 0):
    """A speaker prompt shaped like the runtime's: masked codes at frames 0 and -1."""
    frames, q = config.prompt_frames, config.num_quantizers
    key = mx.random.key(seed)
    codes = mx.random.randint(0, config.codebook_size, (1, frames, q), key=key).astype(mx.int32)
    codes[:, 0] = config.mask_code
    codes[:, -1] = config.mask_code
    subwords = mx.full((1, frames), PAD_ID, mx.int32)
    subword_mask = mx.arange(frames)[None] >= frames - 2
    audio_mask = mx.arange(frames)[None] >= frames - 1
    latent = mx.random.normal((1, frames, config.hidden_size), key=mx.random.key(seed + 1))
    return codes, subwords, subword_mask, audio_mask, latent.astype(mx.bfloat16)


def _layout_keys(prefix: str) -> set[str]:
    keys = set()
    for line in LAYOUT.read_text().splitlines():
        name = line.split()[0]
        if name.startswith(prefix):
            keys.add(name[len(prefix) :])
    return keys


def _collapse(keys) -> set[str]:
    return {re.sub(r"\.\d+(?=\.|$)", ".N", k) for k in keys}


# --- structure ---------------------------------------------------------------


def test_parameter_keys_match_checkpoint_layout(pair):
    ours, _ = pair
    keys = _collapse(k for k, _ in tree_flatten(ours.parameters()))
    assert keys == _layout_keys("tts_model.tts_model.")


def test_parameter_shapes_match_reference(pair):
    ours, ref = pair
    ref_shapes = {k: v.shape for k, v in tree_flatten(ref.parameters())}
    assert {k: v.shape for k, v in tree_flatten(ours.parameters())} == ref_shapes


def test_schedule_fills_every_codebook_once():
    config = TTSConfig.from_dict(_tts_dict())
    counts = unmasking_schedule(config.num_quantizers, config.num_iterations, config.exponent)
    assert len(counts) == config.num_iterations
    assert sum(counts) == config.num_quantizers
    assert all(c >= 0 for c in counts)


def test_set_vocabulary_rejects_wrong_character_count(pair):
    ours, _ = pair
    with pytest.raises(ValueError):
        EarTTS(TTSConfig.from_dict(_tts_dict())).set_vocabulary({"a": 0, "bc": 1})


# --- pure functions ----------------------------------------------------------


def test_top_p_mask_matches_reference():
    logits = mx.random.normal((3, 4, 64), key=mx.random.key(3)) * 3.0
    for top_p in (0.5, 0.95, 1.0):
        ours = top_p_mask(logits, top_p)
        assert mx.array_equal(ours, ref_tts._top_p_logits(logits, top_p))


def test_top_p_mask_always_keeps_the_most_likely():
    logits = mx.array([[0.0, 5.0, 1.0]])
    kept = mx.isfinite(top_p_mask(logits, 1e-6))
    assert kept.tolist() == [[False, True, False]]


def test_rvq_assign_picks_nearest_codes():
    codebooks = mx.random.normal((2, 32, 8), key=mx.random.key(4))
    residual = codebooks[0, 5] + 0.01 * codebooks[1, 7]
    first, second = rvq_assign(residual[None], codebooks)
    assert first.item() == 5
    distances = mx.sum((residual - codebooks[0, 5] - codebooks[1]) ** 2, axis=-1)
    assert second.item() == mx.argmin(distances).item()


def test_rvq_distances_in_one_product_pick_the_same_codes_with_the_same_bits():
    """The depth loop computes ``norms - 2 r.c`` as one addmm where the probe agrees
    (it does on MLX's CPU backend); the codes and every distance stay the same."""
    codebooks = mx.random.normal((4, 64, 16), key=mx.random.key(8))
    norms = codebook_norms(codebooks)
    tables, rows = [codebooks[k] for k in range(4)], [norms[k] for k in range(4)]
    assert distance_in_one_product(tables, rows)
    residual = mx.random.normal((5, 16), key=mx.random.key(9)) * 3
    apart = rvq_assign(residual, tables, rows)
    together = rvq_assign(residual, tables, rows, one_product=True)
    assert all(mx.array_equal(a, b) for a, b in zip(apart, together))
    assert graph_primitives(rvq_assign(residual, tables, rows, one_product=True))["AddMM"] == 4


# --- network parity ----------------------------------------------------------


def test_depthsum_embedding_matches_reference(pair):
    ours, ref = pair
    config = ours.config
    codes = mx.random.randint(0, config.codebook_size + 1, (2, 3, config.num_quantizers),
                              key=mx.random.key(5)).astype(mx.int32)
    assert mx.array_equal(ours.embed_codes(codes), ref.depthsum_embedding(codes))


def test_mog_head_matches_reference(pair):
    ours, ref = pair
    config = ours.config
    x = mx.random.normal((2, 3, config.hidden_size), key=mx.random.key(6))
    mx.random.seed(11)
    mu, logs = ours.mog_head(x, guidance_scale=config.guidance_scale, top_p=config.top_p)
    mx.random.seed(11)
    ref_mu, ref_logs = ref.mog_head.infer(
        x, guidance_scale=config.guidance_scale, top_p=config.top_p
    )
    assert _max_abs(mu, ref_mu) <= 1e-5
    assert _max_abs(logs, ref_logs) <= 1e-5


def test_subword_encoder_matches_reference(pair):
    ours, ref = pair
    ids = mx.array([[WORD_IDS[0], VOCAB["a"], 131_072 + 5, WORD_IDS[1], PAD_ID, 2],
                    [WORD_IDS[2], WORD_IDS[3], VOCAB["z"], 7, 1, WORD_IDS[5]]], mx.int32)
    mask = mx.array([[1, 1, 1, 1, 0, 1], [1, 0, 1, 1, 1, 1]], mx.bool_)
    out = ours.embed_subword(ids, mask)
    expected = ref.embed_subword(ids, mask)
    assert out.dtype == ours.embed_subword.embed_tokens.weight.dtype
    assert _max_abs(out, expected) == 0.0


def test_subword_encoder_without_characters_matches_reference(pair):
    ours, ref = pair
    ids = mx.array([[PAD_ID, 2, 131_080]], mx.int32)
    mask = mx.array([[True, True, False]])
    assert _max_abs(ours.embed_subword(ids, mask), ref.embed_subword(ids, mask)) == 0.0


@pytest.mark.parametrize("with_latent", [True, False])
def test_warmup_hidden_matches_reference(pair, with_latent):
    ours, ref = pair
    codes, subwords, subword_mask, audio_mask, latent = _prompt(ours.config)
    subwords[:, -2:] = mx.array([WORD_IDS[0], WORD_IDS[1]], mx.int32)
    latent = latent if with_latent else None
    hidden, cache = ours.warmup(codes, subwords, subword_mask, audio_mask, latent)
    ref_hidden, _ = ref.warmup(
        codes, subwords, subword_mask, audio_mask, audio_prompt_latent=latent, guidance=True
    )
    assert hidden.shape == (2, ours.config.prompt_frames, ours.config.hidden_size)
    assert len(cache) == ours.config.num_hidden_layers
    assert _max_abs(hidden, ref_hidden) <= 1e-5


class _KeyStream:
    """Explicit keys equal to the global stream after ``mx.random.seed(seed)``."""

    def __init__(self, seed: int):
        self._key = mx.random.key(seed)

    def next(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub


def _run_steps(
    model, seed: int, reference: bool, explicit_keys: bool = False
) -> tuple[list[mx.array], mx.array]:
    config = TTSConfig.from_dict(_tts_dict())
    codes, subwords, subword_mask, audio_mask, latent = _prompt(config)
    if reference:
        _, cache = model.warmup(
            codes, subwords, subword_mask, audio_mask, audio_prompt_latent=latent, guidance=True
        )
    else:
        _, cache = model.warmup(codes, subwords, subword_mask, audio_mask, latent)
    mx.random.seed(seed)
    rng = _KeyStream(seed) if explicit_keys else None
    previous = codes[:, -1:]
    outputs = []
    for word in WORD_IDS[:STEPS]:
        current = mx.array([[word]], mx.int32)
        if reference:
            ones = mx.ones(current.shape, dtype=mx.bool_)
            previous = model.step(previous, current, ones, cache, guidance=True).codes
        else:
            hidden = model.backbone_step(previous, current, [cache])
            previous = model.generate_codes(hidden, None if rng is None else [rng])
        mx.eval(previous)
        outputs.append(previous)
    # The next draw tells whether both consumed the same random stream.
    return outputs, mx.random.uniform(shape=(4,))


def _assert_same_codes(ours, ref, seed: int) -> None:
    got, got_next = _run_steps(ours, seed, reference=False)
    want, want_next = _run_steps(ref, seed, reference=True)
    q = ours.config.num_quantizers
    for frame, (a, b) in enumerate(zip(got, want)):
        assert a.shape == (1, 1, q), frame
        assert a.tolist() == b.tolist(), f"frame {frame}"
        assert int(a.max()) < ours.config.codebook_size
    assert mx.array_equal(got_next, want_next)


@pytest.mark.parametrize("seed", [0, 1])
def test_step_codes_equal_reference_under_seed(pair, seed):
    ours, ref = pair
    _assert_same_codes(ours, ref, seed)


def test_step_with_explicit_key_stream_equals_seeded_reference(pair):
    ours, ref = pair
    got, got_next = _run_steps(ours, 3, reference=False, explicit_keys=True)
    want, _ = _run_steps(ref, 3, reference=True)
    assert [c.tolist() for c in got] == [c.tolist() for c in want]
    # Explicit keys leave the global random state untouched.
    mx.random.seed(3)
    assert mx.array_equal(got_next, mx.random.uniform(shape=(4,)))


def test_step_codes_equal_reference_with_float32_backbone_and_head(pair_f32):
    ours, ref = pair_f32
    assert ours.backbone.layers[0].mlp.gate_proj.weight.dtype == mx.float32
    assert ours.embed_subword.embed_tokens.weight.dtype == mx.bfloat16
    _assert_same_codes(ours, ref, seed=0)


def test_codes_vary_across_frames(pair):
    ours, _ = pair
    got, _ = _run_steps(ours, seed=0, reference=False)
    assert len({tuple(c.reshape(-1).tolist()) for c in got}) > 1


# --- container ---------------------------------------------------------------


def _speech_decoder():
    codec = pytest.importorskip("mlx_voicechat_plugin.models.codec.codec")
    del codec
    from mlx_voicechat_plugin.config import CodecConfig
    from mlx_voicechat_plugin.models.speech.speech import SpeechDecoder

    cfg = fixture_config("tiny")
    return SpeechDecoder(TTSConfig.from_dict(cfg["tts_config"]),
                         CodecConfig.from_dict(cfg["codec_config"]))


def test_speech_decoder_non_codec_keys_match_layout():
    decoder = _speech_decoder()
    keys = {k for k, _ in tree_flatten(decoder.parameters()) if not k.startswith("audio_codec.")}
    expected = {
        k for k in _layout_keys("tts_model.") if not k.startswith("audio_codec.")
    }
    expected = {"control_codes" if k == "_control_codes" else k for k in expected}
    assert _collapse(keys) == expected


def test_speech_decoder_sanitize_renames_control_codes():
    decoder = _speech_decoder()
    weights = {"_control_codes": mx.array([1, 2, 3]), "codec_silence_tokens": mx.zeros((31,))}
    out = decoder.sanitize(weights)
    assert set(out) == {"control_codes", "codec_silence_tokens"}
    assert out["control_codes"].tolist() == [1, 2, 3]
    assert decoder.audio_prompt_latents["Aria"].shape == (1, 37, 64)


def test_compiled_depth_loop_sees_weight_updates():
    """The compiled depth loop reads the module state at call time, not at trace time."""
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_voicechat_plugin.config import TTSConfig
    from mlx_voicechat_plugin.models.speech.ear_tts import EarTTS
    from mlx_voicechat_plugin.runtime.rng import RandomStream
    from mlx_voicechat_plugin.testing.configs import fixture_config

    tts = EarTTS(TTSConfig.from_dict(fixture_config("tiny")["tts_config"]))
    params = tree_flatten(tts.parameters())
    tts.update(tree_unflatten([(k, mx.random.normal(v.shape, key=mx.random.key(i)) * 0.1)
                               for i, (k, v) in enumerate(params)]))
    hidden = mx.random.normal((2, 1, tts.config.hidden_size), key=mx.random.key(9))
    tts.generate_codes(hidden, [RandomStream(0)])
    tts.update(tree_unflatten([("rvq_embs", tts.rvq_embs[::-1])]))
    compiled = tts.generate_codes(hidden, [RandomStream(0)])
    mx.random.seed(0)
    eager = tts._depth_loop(hidden, None)
    assert mx.array_equal(compiled, eager)
