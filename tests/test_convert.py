"""``mlx-voicechat convert``: both source layouts round-trip to the fixture factory's
own profile checkpoints; every failure is a clear error and leaves no output."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.cli.main import main as cli
from mlx_voicechat_plugin.conversion import convert as convert_module
from mlx_voicechat_plugin.conversion.convert import convert
from mlx_voicechat_plugin.conversion.source import ConversionError
from mlx_voicechat_plugin.profiles import PROFILES
from mlx_voicechat_plugin.testing.fixtures import make_checkpoint, question_signal
from mlx_voicechat_plugin.testing.release_layout import make_release_checkpoint


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return make_release_checkpoint(tmp_path_factory.mktemp("release"), "tiny")


@pytest.fixture(scope="module")
def mlx_bf16(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mlx") / "bf16", "tiny")


def _tensors(path: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(file)))
    return out


def _same_tensors(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and mx.array_equal(ta[key], tb[key]).item(), key


def _ids(path: Path) -> tuple:
    model, processor = load(path)
    result = model.create_session(processor).generate(
        question_signal(1.0), extra_decoding_seconds=0.5, seed=3)
    return (result.text_tokens.tolist(), result.function_tokens.tolist(),
            np.asarray(result.audio_codes).tolist(), result.user_transcript)


def _quantization(path: Path):
    return json.loads((path / "config.json").read_text()).get("quantization")


def _profile_record(path: Path):
    return json.loads((path / "config.json").read_text()).get("voicechat_profile")


def _is_the_factory_s(out: Path, tmp_path: Path, profile: str) -> None:
    """A converted checkpoint is the one the fixture factory writes for ``profile``:
    the same tensors, quantization, recorded profile and ids."""
    direct = make_checkpoint(tmp_path / "direct", "tiny", profile=profile)
    _same_tensors(out, direct)
    assert _quantization(out) == _quantization(direct)
    assert _profile_record(out) == _profile_record(direct) == {
        "name": profile, "memory_first": PROFILES[profile].memory_first}
    assert _ids(out) == _ids(direct)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_release_layout_round_trips_to_the_factory_s_profile(release, tmp_path, profile):
    out = convert(release.source, tmp_path / "out", profile, tokenizer=str(release.tokenizer),
                  progress=False).out
    _is_the_factory_s(out, tmp_path, profile)


@pytest.mark.parametrize("profile", ["lean", "bf16"])
def test_an_mlx_conversion_round_trips_to_the_factory_s_profile(mlx_bf16, tmp_path, profile):
    out = convert(mlx_bf16, tmp_path / "out", profile, progress=False).out
    _is_the_factory_s(out, tmp_path, profile)


def test_layers_already_quantized_are_kept(tmp_path):
    """The 4-bit release converted to balanced: its 4-bit LLM as it was, the rest quantized;
    to lean: its LLM stays at the release's group size 64 (lean's own is 128)."""
    release4 = make_checkpoint(tmp_path / "r4", "tiny", profile="release")
    out = convert(release4, tmp_path / "balanced", "balanced", progress=False).out
    _same_tensors(out, make_checkpoint(tmp_path / "direct", "tiny", profile="balanced"))
    lean = convert(release4, tmp_path / "lean", "lean", progress=False).out
    quantization = _quantization(lean)
    assert (quantization["bits"], quantization["group_size"]) == (4, 64)  # the kept LLM
    packed = _tensors(lean)["tts_model.tts_model.backbone.layers.0.mlp.up_proj.weight"]
    assert packed.dtype == mx.uint32 and packed.shape == (128, 64 * 4 // 32)  # 4-bit


def test_bf16_dequantizes_what_the_source_quantized(tmp_path):
    release4 = make_checkpoint(tmp_path / "r4", "tiny", profile="release")
    out = convert(release4, tmp_path / "bf16", "bf16", progress=False).out
    tensors = _tensors(out)
    assert _quantization(out) is None and not any(k.endswith(".scales") for k in tensors)
    stored = _tensors(release4)
    key = "stt_model.lm_head"
    expected = mx.dequantize(stored[f"{key}.weight"], stored[f"{key}.scales"],
                             stored[f"{key}.biases"], group_size=64, bits=4)
    assert mx.array_equal(tensors[f"{key}.weight"], expected).item()
    load(out)


def test_the_output_has_a_model_card_with_measured_sizes(release, tmp_path):
    done = convert(release.source, tmp_path / "out", "lean", tokenizer=str(release.tokenizer),
                   progress=False)
    card = (done.out / "README.md").read_text()
    assert "`lean` profile" in card and f"{done.total:,d}" in card
    on_disk = sum(f.stat().st_size for f in done.out.glob("*.safetensors"))
    assert 0 < done.total <= on_disk < done.total + 64 * 1024  # tensors + the headers
    assert done.written == done.plan.part_bytes()


def test_dry_run_prints_each_part_and_writes_nothing(release, tmp_path, capsys):
    code = cli(["convert", str(release.source), str(tmp_path / "out"), "--profile", "lean",
                "--tokenizer", str(release.tokenizer), "--dry-run"])
    assert code == 0 and not (tmp_path / "out").exists()
    printed = capsys.readouterr().out
    for part in ("llm", "encoder", "tts_backbone", "mog_head", "codec", "total"):
        assert part in printed
    assert "4-bit g64" in printed and "8-bit" in printed


def test_dry_run_sizes_a_config_alone(tmp_path, capsys):
    from mlx_voicechat_plugin.testing.configs import fixture_config

    (tmp_path / "config.json").write_text(json.dumps(fixture_config("small")))
    assert cli(["convert", str(tmp_path), str(tmp_path / "out"), "--dry-run"]) == 0
    assert "sized from config.json shapes" in capsys.readouterr().out


def test_the_command_converts_and_refuses_an_existing_output(release, tmp_path, capsys):
    argv = ["convert", str(release.source), str(tmp_path / "out"), "--profile", "release",
            "--tokenizer", str(release.tokenizer), "--no-progress"]
    assert cli(argv) == 0 and (tmp_path / "out" / "config.json").is_file()
    assert cli(argv) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert cli(argv + ["--force"]) == 0
    assert _leftovers(tmp_path) == []


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_missing_shard_is_named(release, tmp_path, capsys):
    source = _copy(release.source, tmp_path / "src")
    (source / "model-00002-of-00003.safetensors").unlink()
    code = cli(["convert", str(source), str(tmp_path / "out"), "--tokenizer",
                str(release.tokenizer)])
    assert code == 2
    assert "missing shard(s) model-00002-of-00003.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_a_truncated_file_is_named(release, tmp_path):
    source = _copy(release.source, tmp_path / "src")
    shard = source / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ConversionError, match="model-00003-of-00003.safetensors is truncated"):
        convert(source, tmp_path / "out", tokenizer=str(release.tokenizer))
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_an_unknown_profile_names_the_known_ones(release, tmp_path, capsys):
    code = cli(["convert", str(release.source), str(tmp_path / "out"), "--profile", "q2"])
    assert code == 2
    assert "unknown profile 'q2'; known profiles: release, lean, balanced, q8, bf16" in (
        capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_a_source_of_neither_layout_is_refused(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code = cli(["convert", str(tmp_path / "src"), str(tmp_path / "out")])
    assert code == 2
    assert "neither an MLX conversion" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_full_disk_leaves_no_output(release, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = convert_module.ShardWriter.write

    def write(self, name, array):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, name, array)

    monkeypatch.setattr(convert_module.ShardWriter, "write", write)
    with pytest.raises(ConversionError, match="no space left on the device writing .*out"):
        convert(release.source, tmp_path / "out", "lean", tokenizer=str(release.tokenizer),
                progress=False)
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_a_full_disk_keeps_the_output_it_was_to_replace(release, tmp_path, monkeypatch):
    out = convert(release.source, tmp_path / "out", "release", tokenizer=str(release.tokenizer),
                  progress=False).out
    before = sorted(p.name for p in out.iterdir())

    def write(self, name, array):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert_module.ShardWriter, "write", write)
    with pytest.raises(ConversionError, match="no space left"):
        convert(release.source, out, "lean", tokenizer=str(release.tokenizer), force=True,
                progress=False)
    assert sorted(p.name for p in out.iterdir()) == before and _leftovers(tmp_path) == []


def test_shards_are_cut_and_indexed(release, tmp_path):
    out = convert(release.source, tmp_path / "out", "bf16", tokenizer=str(release.tokenizer),
                  progress=False, max_shard_bytes=2**20).out
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    _same_tensors(out, make_checkpoint(tmp_path / "direct", "tiny", profile="bf16"))


def test_the_release_config_reads_as_upstream_s_converter_reads_it(release):
    """Our reader of NVIDIA's config gives what upstream's converter gives, plus the
    EAR-TTS backbone keys it leaves to defaults; the RNNT blank follows the RNNT
    vocabulary where upstream writes the release's 1024."""
    from mlx_vlm.models.nemotron_voicechat.convert import build_runtime_config

    from mlx_voicechat_plugin.conversion.release import runtime_config

    source = json.loads((release.source / "config.json").read_text())
    base = json.loads((release.tokenizer / "config.json").read_text())
    theirs, ours = build_runtime_config(source, base), runtime_config(source, base)
    extra = {"num_iterations", "query_pre_attn_scalar", "rms_norm_eps", "rope_global_base_freq",
             "rope_local_base_freq", "sliding_window_pattern"}
    assert set(ours["tts_config"]) - set(theirs["tts_config"]) == extra
    ours["tts_config"] = {k: v for k, v in ours["tts_config"].items() if k not in extra}
    assert theirs.pop("rnnt_blank_id") == 1024
    assert ours.pop("rnnt_blank_id") == ours["audio_config"]["decoder"]["vocab_size"]
    assert ours == theirs
