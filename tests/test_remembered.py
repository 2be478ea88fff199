"""A checkpoint loaded before is not probed or warmed up again, and gives the same output.

The fused-projection probe's verdicts are remembered per device and shapes,
the EAR-TTS warm start per checkpoint (:mod:`mlx_voicechat_plugin.models.remembered`).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.models import fused as fused_module
from mlx_voicechat_plugin.models.remembered import ENV_CACHE_DIR, PROBE_FILE, cache_dir
from mlx_voicechat_plugin.runtime.warm_start import WarmStart
from mlx_voicechat_plugin.testing.fixtures import make_checkpoint, question_signal


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """A fresh cache directory, and how often the probe and the warm-up run."""
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "cache"))
    runs = {"probe": 0, "warm": 0}
    agrees, run = fused_module._agrees, WarmStart._run.__func__

    def probe(*args):
        runs["probe"] += 1
        return agrees(*args)

    def warm(cls, model):
        runs["warm"] += 1
        return run(cls, model)

    monkeypatch.setattr(fused_module, "_agrees", probe)
    monkeypatch.setattr(WarmStart, "_run", classmethod(warm))
    return runs


def _answer(path):
    from mlx_voicechat_plugin import load

    model, processor = load(path)
    result = model.create_session(processor).generate(question_signal(1.0), seed=3,
                                                      extra_decoding_seconds=0.5)
    return model, result


def test_a_second_load_reads_the_verdicts_and_the_warm_start_back(counted, tmp_path):
    path = make_checkpoint(tmp_path / "tiny", "tiny", quantize_bits=4)
    first_model, first = _answer(path)
    assert counted["probe"] > 0 and counted["warm"] == 1
    probes = counted["probe"]
    verdicts = json.loads((cache_dir() / PROBE_FILE).read_text())
    assert len(verdicts) == len({k for k in verdicts}) and all(verdicts.values())
    second_model, second = _answer(path)
    assert counted["probe"] == probes and counted["warm"] == 1
    assert second_model.fused_blocks == first_model.fused_blocks
    assert np.array_equal(second.audio_codes, first.audio_codes)
    assert list(second.text_tokens) == list(first.text_tokens)
    assert np.array_equal(np.asarray(second.audio), np.asarray(first.audio))


def test_a_changed_checkpoint_or_replaced_weights_are_warmed_up_again(counted, tmp_path):
    from mlx_voicechat_plugin import load

    path = make_checkpoint(tmp_path / "tiny", "tiny")
    _answer(path)
    make_checkpoint(path, "tiny", seed=1)  # the same path, other weights
    _answer(path)
    assert counted["warm"] == 2
    model, processor = load(path)
    weight = model.tts_model.tts_model.backbone.layers[0].mlp.down_proj.weight
    model.update({"tts_model": {"tts_model": {"backbone": {"layers": [
        {"mlp": {"down_proj": {"weight": weight * 2}}}]}}}}, strict=False)
    model.create_session(processor)
    assert counted["warm"] == 3


def test_remembering_off_probes_and_warms_every_load(counted, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_CACHE_DIR, "off")
    assert cache_dir() is None
    path = make_checkpoint(tmp_path / "tiny", "tiny")
    _answer(path)
    probes = counted["probe"]
    _answer(path)
    assert counted["probe"] == 2 * probes and counted["warm"] == 2


def test_an_unreadable_cache_is_ignored(counted, tmp_path):
    path = make_checkpoint(tmp_path / "tiny", "tiny")
    _answer(path)
    (cache_dir() / PROBE_FILE).write_text("{not json")
    for remembered in (cache_dir() / "warm-start").iterdir():
        remembered.write_bytes(b"garbage")
    _, result = _answer(path)
    assert result.audio_codes.size and mx.array(result.audio_codes).dtype is not None


def test_a_second_session_reads_the_symbol_probe_and_the_window_positions_back(
        counted, monkeypatch, tmp_path):
    """A session's start: the RNNT symbol table's probe runs once per device and shapes,
    the encoder's window positions once per checkpoint; read back, both are the same
    bits as computed."""
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.models.perception import perception as perception_module
    from mlx_voicechat_plugin.models.rnnt import prediction_step

    runs = {"rows": 0, "positions": 0}
    rows_agree, positions = prediction_step._rows_agree, perception_module.WindowPositions

    def rows(*args):
        runs["rows"] += 1
        return rows_agree(*args)

    def window_positions(encoder, window, dtype, full=None):
        runs["positions"] += full is None
        return positions(encoder, window, dtype, full)

    monkeypatch.setattr(prediction_step, "_rows_agree", rows)
    monkeypatch.setattr(perception_module, "WindowPositions", window_positions)
    path = make_checkpoint(tmp_path / "tiny", "tiny")
    made = []
    for _ in range(2):
        model, processor = load(path)
        session = model.create_session(processor)
        made.append((session._rnnt._inputs, session._encoder.positions.full))
    assert runs == {"rows": 1, "positions": 1}
    (first_table, first_full), (second_table, second_full) = made
    assert first_table is not None and mx.array_equal(first_table, second_table).item()
    assert len(first_full) == len(second_full)
    assert all(a.dtype == b.dtype and mx.array_equal(a, b).item()
               for a, b in zip(first_full, second_full))


def test_weights_replaced_through_the_model_drop_what_was_derived_from_them(tmp_path):
    """``Model.update`` sets its children's parameters without calling their own
    ``update``: the encoder's window positions (remembered per checkpoint) and the
    EAR-TTS codebook tables must still be recomputed from the new weights."""
    from mlx_voicechat_plugin import load

    path = make_checkpoint(tmp_path / "tiny", "tiny")
    model, _ = load(path)
    perception = model.stt_model.perception
    before = [np.asarray(a) for a in perception.window_positions(model.checkpoint_path).full]
    tts = model.tts_model.tts_model
    tables = tts._codebook_tables()
    weight = perception.encoder.layers[0].self_attn.linear_pos.weight
    model.update({"stt_model": {"perception": {"encoder": {"layers": [
        {"self_attn": {"linear_pos": {"weight": weight * 2}}}]}}}}, strict=False)
    assert getattr(model, "checkpoint_path", None) is None  # nothing remembered applies
    after = [np.asarray(a) for a in perception.window_positions(None).full]
    assert not np.array_equal(after[0], before[0])
    assert tts._codebook_tables() is not tables
