"""The side-by-side diff tool itself."""

from __future__ import annotations

import numpy as np

from conformance.diff import compare, main
from mlx_voicechat_plugin.testing.fixtures import make_question_wav


def test_compare_reports_first_mismatch_and_tolerance():
    exact = compare("ids", [1, 2, 3, 4], [1, 2, 9, 4], None)
    assert (exact.equal, exact.total, exact.first_mismatch, exact.ok) == (3, 4, 2, False)
    close = compare("floats", np.array([0.0, 1.0]), np.array([0.0, 1.0 + 1e-7]), 1e-5)
    assert close.ok and close.first_mismatch is None and close.snr_db > 100


def test_compare_counts_length_differences_as_mismatch():
    diff = compare("codes", [1, 2, 3], [1, 2], None)
    assert not diff.ok and diff.first_mismatch == 2


def test_a_float_stage_of_another_length_fails_and_says_so():
    diff = compare("waveform", np.zeros(10), np.zeros(16), 1e-5)
    assert diff.max_abs == 0.0 and not diff.ok and diff.length_mismatch
    assert "length 10 vs reference 16" in diff.row()


def test_offline_diff_passes_on_fixture(tiny_ckpt, tmp_path, capsys):
    wav = make_question_wav(tmp_path / "q.wav", seconds=1.0)
    assert main([str(tiny_ckpt), str(wav), "--extra-decoding-seconds", "0.5", "--seed", "1"]) == 0
    table = capsys.readouterr().out
    for stage in ("mel", "encoder", "projection", "text_ids", "function_ids", "codes", "waveform"):
        assert stage in table


def test_streaming_diff_passes_on_fixture(tiny_ckpt, tmp_path, capsys):
    wav = make_question_wav(tmp_path / "q.wav", seconds=1.0)
    assert main([str(tiny_ckpt), str(wav), "--stream", "--extra-decoding-seconds", "0.5",
                 "--system-prompt", "Be brief."]) == 0
    assert "codes" in capsys.readouterr().out
