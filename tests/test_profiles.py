"""Precision profiles: parts, formats, lookup, and the fixture factory writing a profile."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlx_voicechat_plugin.config import ModelConfig
from mlx_voicechat_plugin.profiles import (
    PROFILES,
    Format,
    Profile,
    get_profile,
    part_of,
    plan_layers,
    quantizable_modules,
    quantization_config,
)
from mlx_voicechat_plugin.testing.configs import fixture_config
from mlx_voicechat_plugin.testing.fixtures import make_checkpoint


def test_the_profiles_the_issue_names():
    assert {"release", "lean", "q8", "bf16"} <= set(PROFILES)
    assert get_profile("lean").formats["tts_backbone"].bits == 4
    assert get_profile("lean").formats["llm"].group_size == 128


def test_an_unknown_profile_names_the_known_ones():
    known = "release, lean, balanced, q8, bf16"
    with pytest.raises(ValueError, match=f"unknown profile 'tiny4'; known profiles: {known}"):
        get_profile("tiny4")


def test_from_dict_reads_formats_and_refuses_an_unknown_part():
    profile = Profile.from_dict({"name": "mine", "parts": {"llm": "q4",
                                                            "encoder": {"bits": 8}}})
    assert profile.format_of("stt_model.llm.layers.0.mixer.in_proj") == Format("quantized", 4)
    assert profile.format_of("stt_model.perception.proj").bits == 8
    assert profile.format_of("tts_model.audio_codec.decoder.layers.0").kind == "stored"
    assert Profile.from_dict(profile.to_dict()) == profile
    with pytest.raises(ValueError, match="unknown part.*'vocoder'.*llm, encoder"):
        Profile.from_dict({"name": "bad", "parts": {"vocoder": "q4"}})
    with pytest.raises(ValueError, match="bits must be one of"):
        Format.from_value("q3")


def test_parts_by_prefix():
    assert part_of("stt_model.embed_tokens.weight").name == "llm"
    assert part_of("stt_model.rnnt_joint.enc.weight").name == "rnnt"
    assert part_of("tts_model.tts_model.backbone.layers.3.mlp.up_proj").name == "tts_backbone"
    assert part_of("tts_model.tts_model.mog_head.proj_mus").name == "mog_head"
    assert part_of("tts_model.tts_model.embed_code.weight").name == "tts_inputs"
    assert part_of("tts_model.audio_codec.prvq.mus_list.0").name == "codec"
    assert part_of("tts_model._control_codes").name == "other"


def test_lean_quantizes_its_parts_and_leaves_the_rest():
    plans = plan_layers("lean", quantizable_modules(ModelConfig.from_dict(
        fixture_config("small"))))
    by_part: dict[str, set] = {}
    for path, plan in plans.items():
        by_part.setdefault(part_of(path).name, set()).add(
            plan.format.bits if plan.quantized else None)
    assert by_part["llm"] == {4}
    assert 8 in by_part["encoder"]  # (a width no group divides stays as stored)
    assert by_part["tts_backbone"] == by_part["mog_head"] == {get_profile("lean").formats[
        "tts_backbone"].bits}
    assert by_part["rnnt"] == by_part["tts_inputs"] == {None}


def test_quantization_config_is_mlx_lm_style():
    config = quantization_config({"a": (4, 64), "b": (4, 64), "c": (8, 32)})
    assert config == {"group_size": 64, "bits": 4, "mode": "affine",
                      "c": {"group_size": 32, "bits": 8, "mode": "affine"}}
    assert quantization_config({}) is None


def test_release_profile_is_the_4bit_fixture(tmp_path):
    by_profile = make_checkpoint(tmp_path / "p", "tiny", profile="release")
    by_bits = make_checkpoint(tmp_path / "b", "tiny", quantize_bits=4)
    a = mx.load(str(by_profile / "model.safetensors"))
    b = mx.load(str(by_bits / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    quantization = json.loads((by_profile / "config.json").read_text())["quantization"]
    assert (quantization["bits"], quantization["group_size"]) == (4, 64)


def test_bf16_profile_quantizes_nothing(tmp_path):
    path = make_checkpoint(tmp_path / "p", "tiny", profile="bf16")
    assert "quantization" not in json.loads((path / "config.json").read_text())
    assert not any(k.endswith(".scales") for k in mx.load(str(path / "model.safetensors")))


def test_profile_and_bits_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="quantize_bits or profile"):
        make_checkpoint(tmp_path, "tiny", quantize_bits=4, profile="lean")
