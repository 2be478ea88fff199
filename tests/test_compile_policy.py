"""The compile policy (runtime/compile_policy.py): short CPU jobs run uncompiled,
the server compiles and warms its kernels, a cold compile says so."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_voicechat_plugin.cli import generate, serve
from mlx_voicechat_plugin.runtime import compile_policy


def test_short_cpu_jobs_run_uncompiled_and_long_ones_compile():
    assert compile_policy.backend() == "cpu"
    assert compile_policy.choose(None, long_running=False) is False
    assert compile_policy.choose(None, long_running=True) is True
    assert compile_policy.choose(True, long_running=False) is True
    assert compile_policy.choose(False, long_running=True) is False


def _traces(enabled: bool) -> int:
    traced = []

    def f(x):
        traced.append(1)
        return x * 2

    g = mx.compile(f)
    compile_policy.apply(enabled, long_running=False)
    for _ in range(3):
        mx.eval(g(mx.array([1.0])))
    return len(traced)


def test_apply_switches_mx_compile_process_wide():
    assert _traces(True) == 1  # traced once, then the compiled graph runs
    assert _traces(False) == 3  # plain Python every call


def test_a_cold_kernel_cache_is_announced(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compile_policy, "kernel_cache_dir", lambda: tmp_path / "none")
    compile_policy.apply(True, long_running=True)
    assert "compiling MLX CPU kernels" in capsys.readouterr().err
    (tmp_path / "warm").mkdir()
    (tmp_path / "warm" / "libkernel.so").write_bytes(b"")
    monkeypatch.setattr(compile_policy, "kernel_cache_dir", lambda: tmp_path / "warm")
    compile_policy.apply(True, long_running=True)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flag,value", [([], None), (["--compile"], True), (["--no-compile"], False)])
def test_the_commands_take_compile_flags(flag, value):
    assert generate.parse(["-m", "x", "--audio", "q.wav", *flag], "g", False).compile is value
    assert serve.parse(["-m", "x", *flag], "s", False).compile is value


def test_a_finished_compiled_run_lets_later_short_runs_compile(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_policy, "kernel_cache_dir", lambda: tmp_path)
    key = compile_policy.model_key({"model_type": "nemotron_voicechat", "x": 1})
    assert compile_policy.choose(None, long_running=False, key=key) is False
    compile_policy.apply(False, long_running=False)
    compile_policy.mark_warm(key)  # an uncompiled run proves nothing
    assert not compile_policy.is_warm(key)
    compile_policy.apply(True, long_running=False)
    compile_policy.mark_warm(key)
    assert compile_policy.choose(None, long_running=False, key=key) is True
    other = compile_policy.model_key({"model_type": "nemotron_voicechat", "x": 2})
    assert compile_policy.choose(None, long_running=False, key=other) is False
