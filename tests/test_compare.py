"""``mlx-voicechat compare``: one question through two checkpoints, on the tiny fixture."""

from __future__ import annotations

import inspect
import json
import math
import shutil

import pytest

from mlx_voicechat_plugin.cli.compare import compare_checkpoints, id_stage
from mlx_voicechat_plugin.cli.main import main as cli
from mlx_voicechat_plugin.loader import load
from mlx_voicechat_plugin.testing.fixtures import cached_checkpoint, make_question_wav


@pytest.fixture(scope="module")
def question(tmp_path_factory):
    return make_question_wav(tmp_path_factory.mktemp("q") / "q.wav", 1.5)


def test_a_checkpoint_against_its_copy_agrees_everywhere(question, tmp_path):
    a = cached_checkpoint("tiny")
    b = shutil.copytree(a, tmp_path / "copy")
    report = compare_checkpoints(a, b, question, seed=1, extra_decoding_seconds=0.5)
    assert all(s.equal == s.total and s.first_divergence is None for s in report.ids)
    assert all(math.isinf(s.snr_db) and s.max_abs == 0 for s in report.floats)
    assert report.a.user_transcript == report.b.user_transcript != ""
    assert report.a.answer == report.b.answer
    assert report.a.answer_heard == report.b.answer_heard


def test_the_report_of_two_profiles(question, capsys):
    a, b = cached_checkpoint("tiny"), cached_checkpoint("tiny", profile="balanced")
    assert cli(["compare", str(a), str(b), "--audio", str(question), "--seed", "1",
                "--extra-decoding-seconds", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["a"]["path"] == str(a) and report["b"]["path"] == str(b)
    for side in ("a", "b"):
        assert {"user_transcript", "answer", "answer_heard"} <= set(report[side])
    stages = {s["stage"]: s for s in report["float_stages"] + report["id_stages"]}
    assert set(stages) == {"mel", "encoder", "projection", "llm_logits", "tts_backbone",
                           "mog_logits", "waveform", "text_ids", "function_ids", "codes"}
    assert stages["mel"]["snr_db"] is None  # identical: the log-mel has no weights
    assert stages["encoder"]["snr_db"] > 20  # the 8-bit encoder, against bf16
    assert stages["tts_backbone"]["snr_db"] > 20  # 8-bit, teacher-forced on the same tokens
    assert stages["text_ids"]["total"] == stages["codes"]["total"] > 0


def test_the_text_report_names_each_stage(question, capsys):
    a, b = cached_checkpoint("tiny"), cached_checkpoint("tiny", profile="release")
    assert cli(["compare", str(a), str(b), "--audio", str(question),
                "--extra-decoding-seconds", "0"]) == 0
    printed = capsys.readouterr().out
    for line in ("user transcript:", "answer heard:", "text_ids", "codes", "encoder",
                 "waveform", "same user transcript"):
        assert line in printed


def test_id_agreement_and_first_divergence():
    assert id_stage("t", [1, 2, 3, 4], [1, 2, 9, 4]).__dict__ == {
        "stage": "t", "equal": 3, "total": 4, "first_divergence": 2}
    assert id_stage("t", [1, 2], [1, 2, 3]).first_divergence == 2  # a longer side
    assert id_stage("c", [[1, 2], [3, 4]], [[1, 2], [3, 5]]).first_divergence == 1


def test_two_budgets_of_one_checkpoint(question, capsys):
    a = str(cached_checkpoint("tiny"))
    argv = ["compare", a, "--audio", str(question), "--memory-budget", "0.5", "64",
            "--extra-decoding-seconds", "0", "--top-p", "0.5"]  # sampling reaches both sides
    if "memory_budget" not in inspect.signature(load).parameters:
        assert cli(argv) == 2
        assert "takes no memory budget" in capsys.readouterr().err
        return
    assert cli(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [report[s]["memory_budget"] for s in ("a", "b")] == [0.5, 64]
    assert all(s["equal"] == s["total"] for s in report["id_stages"])


def test_one_checkpoint_needs_two_budgets(question, capsys):
    with pytest.raises(SystemExit):
        cli(["compare", str(cached_checkpoint("tiny")), "--audio", str(question)])
    assert "give checkpoint B" in capsys.readouterr().err
