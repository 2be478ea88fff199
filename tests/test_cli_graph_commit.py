"""``--graph-commit-ops N`` (runtime/device_settings.py): MLX_MAX_OPS_PER_BUFFER set before load.

MLX reads the variable once, when the GPU device is first used, so the
commands must set it before the model loads: the loader is replaced by one
that reads the environment and stops the command there. Out-of-range values
are refused naming the flag and its limit; without the flag (or with 0) the
environment is left as it was.
"""

from __future__ import annotations

import logging
import os

import pytest

from mlx_voicechat_plugin.cli import generate, serve
from mlx_voicechat_plugin.runtime import compile_policy
from mlx_voicechat_plugin.runtime.device_settings import (
    GRAPH_COMMIT_ENV, MAX_GRAPH_COMMIT_OPS, apply_graph_commit_ops)

GENERATE = ["-m", "ckpt", "--audio", "q.wav"]
SERVE = ["-m", "ckpt"]


class Loaded(Exception):
    """Raised by the stand-in loader: the command got as far as loading."""


def test_apply_sets_the_variable_and_logs_it(monkeypatch, caplog):
    monkeypatch.delenv(GRAPH_COMMIT_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="mlx_voicechat_plugin.runtime.device_settings"):
        assert apply_graph_commit_ops(400) == "400"
    assert os.environ[GRAPH_COMMIT_ENV] == "400"
    assert f"{GRAPH_COMMIT_ENV}=400" in caplog.text


@pytest.mark.parametrize("n", [None, 0])
def test_no_value_leaves_the_environment_as_it_was(monkeypatch, n):
    monkeypatch.delenv(GRAPH_COMMIT_ENV, raising=False)
    assert apply_graph_commit_ops(n) is None
    assert GRAPH_COMMIT_ENV not in os.environ
    monkeypatch.setenv(GRAPH_COMMIT_ENV, "77")  # a value set by hand stays
    assert apply_graph_commit_ops(n) is None
    assert os.environ[GRAPH_COMMIT_ENV] == "77"


@pytest.mark.parametrize("value", ["-1", str(MAX_GRAPH_COMMIT_OPS + 1)])
@pytest.mark.parametrize("command, argv", [(generate, GENERATE), (serve, SERVE)],
                         ids=["generate", "serve"])
def test_out_of_range_values_name_the_flag_and_its_limit(command, argv, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        command.parse([*argv, "--graph-commit-ops", value], "cmd", False)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--graph-commit-ops must be an integer from 1 to {MAX_GRAPH_COMMIT_OPS}" in err
    assert value in err


@pytest.mark.parametrize("command, argv", [(generate, GENERATE), (serve, SERVE)],
                         ids=["generate", "serve"])
def test_a_non_integer_is_refused_and_the_default_is_none(command, argv, capsys):
    with pytest.raises(SystemExit):
        command.parse([*argv, "--graph-commit-ops", "lots"], "cmd", False)
    assert "--graph-commit-ops" in capsys.readouterr().err
    assert command.parse(argv, "cmd", False).graph_commit_ops is None
    assert command.parse([*argv, "--graph-commit-ops", "0"], "cmd", False).graph_commit_ops == 0


def _stop_at_load(monkeypatch) -> list[str | None]:
    """Replace what loads the model in both commands by a reader of the environment."""
    seen: list[str | None] = []

    def load(*args, **kwargs):
        seen.append(os.environ.get(GRAPH_COMMIT_ENV))
        raise Loaded

    monkeypatch.setattr("mlx_voicechat_plugin.loader.load", load)
    monkeypatch.setattr("mlx_voicechat_plugin.server.app.create_app", load)
    monkeypatch.setattr(compile_policy, "apply", lambda *args, **kwargs: False)
    return seen


@pytest.mark.parametrize("flag, expected", [(["--graph-commit-ops", "400"], "400"), ([], None)],
                         ids=["flag", "absent"])
@pytest.mark.parametrize("command, argv", [(generate, GENERATE), (serve, SERVE)],
                         ids=["generate", "serve"])
def test_the_variable_is_set_before_the_model_loads(monkeypatch, command, argv, flag, expected,
                                                    real):
    pytest.importorskip("uvicorn")
    monkeypatch.delenv(GRAPH_COMMIT_ENV, raising=False)
    seen = _stop_at_load(monkeypatch)
    with pytest.raises(Loaded):
        command.main([*real[command], *flag])
    assert seen == [expected]


def test_an_absent_flag_keeps_a_value_set_by_hand(monkeypatch, real):
    monkeypatch.setenv(GRAPH_COMMIT_ENV, "250")
    seen = _stop_at_load(monkeypatch)
    with pytest.raises(Loaded):
        generate.main(real[generate])
    assert seen == ["250"]


@pytest.fixture
def real(tiny_ckpt, tmp_path):
    """Each command's argv naming files that exist: the paths are checked before loading."""
    from mlx_voicechat_plugin.testing.fixtures import make_question_wav

    wav = make_question_wav(tmp_path / "q.wav", seconds=0.5)
    return {generate: ["-m", str(tiny_ckpt), "--audio", str(wav)],
            serve: ["-m", str(tiny_ckpt), "--port", "0"]}
