"""The codec equals the reference codec, and its stream equals its offline decode.

Both codecs get the same random weights in NeMo (PyTorch) layout, each through
its own ``sanitize``; the reference is mlx-audio's ``NemotronVoiceChatCodec``.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_audio.codec.models.nemotron_voicechat.codec import NemotronVoiceChatCodec
from mlx_audio.codec.models.nemotron_voicechat.config import (
    NemotronVoiceChatCodecConfig,
)

from mlx_voicechat_plugin.config import CodecConfig
from mlx_voicechat_plugin.models.codec.codec import Codec
from mlx_voicechat_plugin.testing.configs import fixture_config

LAYOUT = Path(__file__).parent / "data" / "checkpoint_layout_tiny.txt"
PREFIX = "tts_model.audio_codec."
FRAMES = 4


def _max_abs(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))))


def _torch_shape(key: str, shape: tuple[int, ...], transposed: set[str]) -> tuple:
    """The on-disk (PyTorch) shape of an MLX parameter."""
    if len(shape) != 3:
        return shape
    out, k, inp = shape
    return (inp, out, k) if key in transposed else (out, inp, k)


def _nemo_weights(codec: Codec) -> dict[str, mx.array]:
    """Random codec weights as the checkpoint stores them (PyTorch layouts)."""
    transposed = {
        f"decoder.layers.{i}.weight"
        for i, layer in enumerate(codec.decoder.layers)
        if isinstance(layer, nn.ConvTranspose1d)
    }
    key = mx.random.key(0)
    weights = {}
    for name, param in tree_flatten(codec.parameters()):
        key, sub = mx.random.split(key)
        shape = _torch_shape(name, param.shape, transposed)
        if name.startswith("prvq.variance_list."):
            name = name.replace("variance_list", "_variance_list")
            value = 1.0 + 0.1 * mx.random.uniform(shape=shape, key=sub)
        elif name.startswith("prvq.mus_list."):
            value = 0.5 * mx.random.normal(shape, key=sub)
        elif name.endswith("norm.weight"):
            value = 1.0 + 0.1 * mx.random.normal(shape, key=sub)
        else:
            value = 0.1 * mx.random.normal(shape, key=sub)
        weights[name] = value
    return weights


@pytest.fixture(scope="module")
def config() -> CodecConfig:
    return CodecConfig.from_dict(fixture_config("tiny")["codec_config"])


@pytest.fixture(scope="module")
def nemo_weights(config) -> dict[str, mx.array]:
    return _nemo_weights(Codec(config))


@pytest.fixture(scope="module")
def ours(config, nemo_weights) -> Codec:
    codec = Codec(config)
    codec.load_weights(list(codec.sanitize(nemo_weights).items()), strict=True)
    mx.eval(codec.parameters())
    return codec


@pytest.fixture(scope="module")
def reference(nemo_weights) -> NemotronVoiceChatCodec:
    values = fixture_config("tiny")["codec_config"]
    codec = NemotronVoiceChatCodec(NemotronVoiceChatCodecConfig.from_dict(values))
    codec.load_weights(list(codec.sanitize(nemo_weights).items()), strict=True)
    mx.eval(codec.parameters())
    return codec


@pytest.fixture(scope="module")
def codes(config) -> mx.array:
    shape = (2, config.num_quantizers, FRAMES)
    return mx.random.randint(0, config.codebook_size, shape, key=mx.random.key(1))


def _layout_groups(text: str) -> dict[str, set[str]]:
    groups = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(\S+)\s+x\d+\s+(.+)", line.strip())
        if match and match.group(1).startswith(PREFIX):
            shapes = {spec.strip().rsplit(" ", 1)[0] for spec in match.group(2).split(";")}
            groups[match.group(1)[len(PREFIX) :]] = shapes
    return groups


def _groups(weights: dict[str, mx.array]) -> dict[str, set[str]]:
    groups: dict[str, set[str]] = {}
    for key, value in weights.items():
        group = ".".join("N" if part.isdigit() else part for part in key.split("."))
        groups.setdefault(group, set()).add(str(list(value.shape)))
    return groups


def test_checkpoint_layout_matches_tiny_fixture(nemo_weights):
    assert _groups(nemo_weights) == _layout_groups(LAYOUT.read_text())


def test_parameter_keys_are_the_sanitized_checkpoint_keys(ours, nemo_weights):
    own = {key for key, _ in tree_flatten(ours.parameters())}
    assert own == set(ours.sanitize(nemo_weights))


def test_sanitize_is_idempotent(ours, nemo_weights):
    once = ours.sanitize(nemo_weights)
    twice = ours.sanitize(once)
    assert once.keys() == twice.keys()
    assert all(mx.array_equal(once[k], twice[k]) for k in once)


@pytest.mark.parametrize("extra", [0, 1000])
def test_encode_matches_reference_on_noise(ours, reference, config, extra):
    samples = FRAMES * config.samples_per_frame + extra
    waveform = 0.3 * mx.random.normal((2, 1, samples), key=mx.random.key(2))
    codes = ours.encode(waveform)
    assert codes.shape == (2, config.num_quantizers, FRAMES)
    assert codes.dtype == mx.int32
    assert mx.array_equal(codes, reference.encode(waveform))


def test_encode_matches_reference_on_silence(ours, reference, config):
    waveform = mx.zeros((1, FRAMES * config.samples_per_frame))
    assert mx.array_equal(ours.encode(waveform), reference.encode(waveform))


def test_decode_matches_reference(ours, reference, codes, config):
    waveform = ours.decode(codes)
    assert waveform.shape == (2, 1, FRAMES * config.samples_per_frame)
    assert waveform.dtype == mx.float32
    assert _max_abs(waveform, reference.decode(codes)) <= 1e-6


def test_decode_with_fewer_codebooks_matches_reference(ours, reference, codes):
    assert _max_abs(ours.decode(codes[:, :5]), reference.decode(codes[:, :5])) <= 1e-6


@pytest.mark.parametrize("chunks", [[1, 1, 1, 1], [3, 1], [4]])
def test_stream_equals_offline_decode(ours, codes, chunks):
    state = ours.make_state(batch=2)
    pieces, start = [], 0
    for size in chunks:
        pieces.append(ours.decode_step(codes[..., start : start + size], state))
        start += size
    pieces.append(ours.flush(state))
    streamed = mx.concatenate(pieces, axis=-1)
    offline = ours.decode(codes)
    assert streamed.shape == offline.shape
    assert _max_abs(streamed, offline) <= 1e-6


def test_stream_holds_back_only_the_istft_overlap(ours, codes, config):
    state = ours.make_state(batch=2)
    first = ours.decode_step(codes[..., :1], state)
    second = ours.decode_step(codes[..., 1:3], state)
    tail = ours.flush(state)
    lag = ours.stream_lag
    assert lag == (config.n_fft - config.hop_length) // 2
    assert first.shape[-1] == config.samples_per_frame - lag
    assert second.shape[-1] == 2 * config.samples_per_frame
    assert tail.shape[-1] == lag


def test_flushed_stream_refuses_more_codes(ours, codes):
    state = ours.make_state(batch=2)
    ours.flush(state)
    with pytest.raises(ValueError):
        ours.decode_step(codes, state)


def test_stacked_codebooks_decode_the_same_latents_with_one_gather(config):
    from mlx_voicechat_plugin.models.codec.codec_rvq import ProbabilisticRVQ
    from mlx_voicechat_plugin.instruments.kernels import graph_primitives

    prvq = ProbabilisticRVQ(config)
    prvq.mus_list = [mx.random.normal(m.shape, key=mx.random.key(q))
                     for q, m in enumerate(prvq.mus_list)]
    codes = mx.random.randint(0, config.codebook_size, (2, len(prvq.mus_list), 3),
                              key=mx.random.key(99))
    apart = prvq.decode(codes)
    prvq.stack()
    assert mx.array_equal(prvq.decode(codes), apart)
    assert mx.array_equal(prvq.decode(codes[:, :5]), ProbabilisticRVQ.decode(prvq, codes[:, :5]))
    assert graph_primitives(prvq.decode(codes))["Gather"] == 1
    prvq.mus_list[0] = prvq.mus_list[0] * 1  # a replaced codebook: one gather each again
    assert graph_primitives(prvq.decode(codes))["Gather"] == len(prvq.mus_list)
