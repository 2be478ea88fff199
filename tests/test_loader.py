"""``load(path_or_repo)``: strict, idempotent sanitize, clear errors."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.loader import read_weights


def test_load_returns_model_and_tokenizer(tiny_ckpt):
    model, processor = load(tiny_ckpt)
    assert model.model_type == "nemotron_voicechat"
    assert processor.encode("hello", add_special_tokens=False)


def test_sanitize_is_idempotent(tiny_ckpt):
    model, _ = load(tiny_ckpt, lazy=True)
    once = model.sanitize(read_weights(tiny_ckpt))
    twice = model.sanitize(once)
    assert once.keys() == twice.keys()
    assert all(mx.array_equal(once[k], twice[k]) for k in once)


def test_sanitize_sums_lstm_biases_and_drops_mel_buffers(tiny_ckpt):
    model, _ = load(tiny_ckpt, lazy=True)
    raw = read_weights(tiny_ckpt)
    out = model.sanitize(raw)
    stem = "stt_model.rnnt_decoder.prediction.dec_rnn.lstm"
    assert mx.array_equal(out[f"{stem}.0.bias"], raw[f"{stem}.bias_ih_l0"] + raw[f"{stem}.bias_hh_l0"])
    assert not any(k.startswith("stt_model.perception.preprocessor.") for k in out)


def test_other_speakers_are_rejected_at_load(tiny_ckpt, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, copy)
    config = json.loads((copy / "config.json").read_text())
    config["speaker"] = "Bob"
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="speaker 'Bob' is not supported"):
        load(copy)


def test_missing_tensor_fails_strict_loading(tiny_ckpt, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, copy)
    weights = read_weights(copy)
    weights.pop("stt_model.lm_head.weight")
    (copy / "model.safetensors.index.json").unlink()
    (copy / "model.safetensors").unlink()
    mx.save_safetensors(str(copy / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="lm_head"):
        load(copy)


def test_wrong_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="model_type"):
        load(tmp_path)
