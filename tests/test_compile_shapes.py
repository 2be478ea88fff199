"""A compile policy that is right on CUDA: short jobs uncompiled on a cold kernel cache,
and compiled steps that never retrace per position or cache length.

On CUDA, MLX builds every fused kernel with NVRTC at its first use, once per
shape; a step that met a new shape every frame would build kernels all
conversation long. Here ``mx.compile`` is wrapped to count traces (each trace
is a new graph, hence new kernels): after the server's warm-up, real speech in
a pool of two sessions traces nothing new, and the RNNT's later tries trace
once per batch size whichever rows emit.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.runtime import compile_policy


@pytest.mark.parametrize("backend,short,long", [("cpu", False, True), ("cuda", False, True),
                                                ("metal", True, True)])
def test_short_jobs_compile_only_where_kernels_build_fast(monkeypatch, tmp_path, backend,
                                                          short, long):
    monkeypatch.setattr(compile_policy, "backend", lambda: backend)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    assert compile_policy.choose(None, long_running=False) is short
    assert compile_policy.choose(None, long_running=True) is long
    assert compile_policy.choose(True, long_running=False) is True


def test_cuda_kernel_cache_is_mlx_ptx_cache(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compile_policy, "backend", lambda: "cuda")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    assert compile_policy.kernel_cache_dir() == tmp_path / "ptx"
    assert compile_policy.kernel_cache_is_cold()
    compile_policy.apply(True, long_running=True)
    assert "compiling MLX CUDA kernels" in capsys.readouterr().err
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "kernel.ptx").write_bytes(b"")
    assert not compile_policy.kernel_cache_is_cold()
    key = compile_policy.model_key({"x": 1})
    compile_policy.mark_warm(key)
    assert compile_policy.choose(None, long_running=False, key=key) is True


def test_cpu_backend_is_detected():
    assert compile_policy.backend() == "cpu"


@pytest.fixture
def traces(monkeypatch):
    counted: Counter = Counter()
    real = mx.compile

    def counting(fun, *args, **kwargs):
        name = getattr(fun, "__qualname__", None) or \
            getattr(getattr(fun, "func", None), "__qualname__", repr(fun))

        def traced(*a, **k):
            counted[name] += 1
            return fun(*a, **k)

        return real(traced, *args, **kwargs)

    monkeypatch.setattr(mx, "compile", counting)
    mx.enable_compile()
    return counted


def test_after_the_warm_up_speech_traces_nothing_new(tiny_ckpt, traces):
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.runtime.options import ConversationOptions
    from mlx_voicechat_plugin.runtime.pool import StreamPool
    from mlx_voicechat_plugin.server.engine.scheduler import StepCosts
    from mlx_voicechat_plugin.server.engine.warm_up import run_warm_up
    from mlx_voicechat_plugin.testing.fixtures import question_signal

    model, processor = load(tiny_ckpt)
    voicechat = model.create_session(processor)
    run_warm_up(voicechat, 2, StepCosts(), lambda: None)
    assert traces, "the warm-up compiled nothing"
    warmed = Counter(traces)
    pool = StreamPool(voicechat, max_sessions=2)
    frame = voicechat.config.frame_samples
    audio = [question_signal(7.0, seed=s) for s in (0, 1)]
    for seed in (0, 1):
        pool.open(str(seed), ConversationOptions(seed=seed))
    emitted = 0
    for index in range(len(audio[0]) // frame):
        result = pool.step({str(s): audio[s][index * frame : (index + 1) * frame]
                            for s in (0, 1)})
        assert not result.errors
        emitted += sum(1 for events in result.events.values() for e in events
                       if type(e).__name__ == "UserTranscriptDelta")
    pool.close_all()
    assert emitted > 0  # the RNNT's later tries ran on speech
    assert traces == warmed, {k: traces[k] - warmed[k] for k in traces if traces[k] != warmed[k]}


def test_the_rnnt_later_tries_trace_once_per_batch_size(tiny_ckpt, traces):
    from mlx_voicechat_plugin.models.rnnt.rnnt import RNNTCarry
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    greedy = model.create_session(processor).new_rnnt_state().greedy
    width = model.config.audio_config.encoder.d_model
    for active in ([True, False, False], [False, True, True], [True, True, True]):
        carry = RNNTCarry.merge([greedy.initial(mx.float32) for _ in range(3)])
        before = [np.array(a) for a in carry.state]
        symbols = greedy(mx.ones((3, 1, width)), carry, greedy.max_symbols - 1, active)
        mx.eval(symbols, carry.state)
        for row, on in enumerate(active):  # a held row keeps its carry bit for bit
            if not on:
                assert all(np.array_equal(np.array(a)[row], b[row])
                           for a, b in zip(carry.state, before))
                assert set(np.array(symbols)[row].tolist()) == {greedy.blank_id}
    assert sum(n for name, n in traces.items() if "_unrolled" in name) == 1
