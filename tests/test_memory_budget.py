"""The memory budget: the loader's float32 choice, its refusals, and exactness either way.

A budget too small for the float32 copies loads the weights as stored; the
network must then give the reference's ids and codes exactly, as with the
copies held (MLX upcasts bf16 weights to the float32 activations they
multiply, so holding them is a speed choice, never a numerical one).
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conformance.diff import run_pair
from mlx_voicechat_plugin.budget import (
    GIB,
    MARGIN_FRACTION,
    BudgetExceeded,
    budget_bytes,
    device_memory,
    fit_sessions,
    plan_memory,
    profile_sizes,
)
from mlx_voicechat_plugin.config import ModelConfig
from mlx_voicechat_plugin.testing.configs import fixture_config
from mlx_voicechat_plugin.testing.fixtures import question_signal


def _load(path, **kwargs):
    from mlx_voicechat_plugin import load

    return load(path, **kwargs)


def _as_stored_budget(plan) -> float:
    """A budget (GiB) where the stored weights and a session fit with the margin, and
    the float32 copies do not."""
    low = (plan.stored + plan.session) / (1 - MARGIN_FRACTION)
    high = (plan.stored + plan.hold_extra + plan.session) / (1 - MARGIN_FRACTION)
    assert low < high
    return (low + high) / 2 / GIB


def test_the_default_budget_is_the_device_s():
    budget, source = device_memory()
    assert budget > 0 and source
    assert budget_bytes(None) == (budget, source)
    assert budget_bytes(2.5) == (int(2.5 * GIB), "--memory-budget")


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "8"])
def test_a_bad_budget_names_the_field(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        budget_bytes(bad)


def test_a_large_budget_holds_float32_and_a_small_one_keeps_the_stored_weights(tiny_q4_ckpt):
    model, _ = _load(tiny_q4_ckpt)
    plan = model.memory_plan
    assert plan.hold_f32 and plan.hold_extra > 0
    held = dict(tree_flatten(model.parameters()))
    assert held["stt_model.perception.proj.weight"].dtype == mx.float32

    small, _ = _load(tiny_q4_ckpt, memory_budget=_as_stored_budget(plan))
    assert not small.memory_plan.hold_f32
    assert small.memory_plan.stored == plan.stored
    stored = dict(tree_flatten(small.parameters()))
    assert stored["stt_model.perception.proj.weight"].dtype == mx.bfloat16


def test_a_checkpoint_that_cannot_fit_is_refused_naming_a_profile_that_does():
    config = ModelConfig.from_dict(fixture_config("small"))
    sizes = profile_sizes(config)
    assert sizes["lean"] < sizes["release"] < sizes["bf16"]
    assert sizes["q8"] < sizes["bf16"]
    plan = plan_memory(config, sizes["bf16"], 0, None)
    # Room for the release profile's weights and a session, not the bf16 ones.
    budget = (sizes["release"] + plan.session + 1) / GIB
    with pytest.raises(BudgetExceeded, match="'release' profile") as refused:
        plan_memory(config, sizes["bf16"], 0, budget)
    assert "--profile release" in str(refused.value)
    with pytest.raises(BudgetExceeded, match="no profile fits"):
        plan_memory(config, sizes["bf16"], 0, plan.session / 2 / GIB)


def test_the_server_is_sized_to_what_the_budget_leaves():
    config = ModelConfig.from_dict(fixture_config("small"))
    stored = profile_sizes(config, ["release"])["release"]
    session = plan_memory(config, stored, 0, None).session
    budget = (stored + 3.5 * session) / (1 - MARGIN_FRACTION) / GIB  # 3 sessions fit
    plan = plan_memory(config, stored, 0, budget)
    assert plan.sessions_that_fit() == 3
    sessions, state, line = fit_sessions(plan, 8, None)
    assert (sessions, state) == (3, plan.left)
    assert "up to 3 session(s) (--max-sessions 8; fewer fit)" in line
    assert f"within {plan.left} bytes of session state (--max-state-bytes unset" in line
    assert fit_sessions(plan, 2, 10)[:2] == (2, 10)
    sessions, state, line = fit_sessions(plan, 2, 10 * plan.left)
    assert (sessions, state) == (2, plan.left) and "lowered to what is left" in line


def test_the_budget_flag_is_on_every_command():
    from mlx_voicechat_plugin.cli import demo, generate, serve, transcribe

    for build in (generate.build_parser, serve.build_parser, transcribe.build_parser):
        args, _ = build().parse_known_args(["--model", "m", "--audio", "a.wav",
                                            "--memory-budget", "10.67"])
        assert args.memory_budget == pytest.approx(10.67)
    with pytest.raises(SystemExit):
        demo.main(["--memory-budget", "0"])


def test_a_bad_budget_flag_exits_2_naming_it(capsys):
    from mlx_voicechat_plugin.cli.generate import parse

    with pytest.raises(SystemExit) as done:
        parse(["--model", "m", "--audio", "a.wav", "--memory-budget", "-1"], "g", False)
    assert done.value.code == 2
    assert "--memory-budget must be a positive number of GiB" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny_q4_ckpt", "small_ckpt"])
def test_weights_as_stored_match_the_reference_at_every_stage(name, request, question_audio):
    from mlx_vlm.utils import load as reference_load

    path = request.getfixturevalue(name)
    ours = _load(path, hold_f32=False)
    assert not ours[0].memory_plan.hold_f32
    for seed in (0, 1):
        diffs = run_pair(path, question_audio, seed=seed, extra_decoding_seconds=1.0,
                         reference_language_cache=True,
                         loaded=(ours, reference_load(str(path))))
        failed = {d.stage: d.row() for d in diffs if not d.ok}
        assert not failed, failed


def test_weights_as_stored_stream_as_offline_and_as_held(tiny_q4_ckpt):
    audio = np.concatenate([question_signal(1.5), np.zeros(8000, np.float32)])
    codes = {}
    for hold in (True, False):
        model, processor = _load(tiny_q4_ckpt, hold_f32=hold)
        session = model.create_session(processor)
        # As stored, no float32 copies outside the weights either: the codebook
        # tables and the RNNT's LSTM are used as stored (exactly, as the codes show).
        tables = model.tts_model.tts_model._codebooks
        assert (tables.tables32 is not tables.tables) == hold
        assert (session._rnnt._held is not None) == hold
        stream = session.create_streaming_session(seed=2)
        events = []
        for start in range(0, len(audio), 1280):
            events += stream.push_audio(audio[start:start + 1280])
        events += stream.flush()
        streamed = np.stack([e.audio_codes for e in events
                             if getattr(e, "audio_codes", None) is not None
                             and e.audio_codes.size])
        offline = session.generate(audio, extra_decoding_seconds=0.0, seed=2)
        assert np.array_equal(offline.audio_codes[: len(streamed)], streamed)
        codes[hold] = streamed
    assert np.array_equal(codes[True], codes[False])


def test_serve_parses_the_budget_into_the_app():
    from mlx_voicechat_plugin.cli.serve import parse

    args = parse(["--model", "m", "--memory-budget", "10.67"], "serve", False)
    assert isinstance(args, argparse.Namespace) and args.memory_budget == pytest.approx(10.67)


def test_a_memory_first_profile_holds_no_float32_copies_whatever_the_budget(tmp_path, caplog):
    """``lean`` exists to stay small (6.5 GiB of weights at full size, which its float32
    copies would pass): its config.json says so and the default load respects it."""
    import json
    import logging

    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint

    path = make_checkpoint(tmp_path / "lean", "tiny", profile="lean")
    assert json.loads((path / "config.json").read_text())["voicechat_profile"] == {
        "name": "lean", "memory_first": True}
    with caplog.at_level(logging.INFO, logger="mlx_voicechat_plugin.loader"):
        model, _ = _load(path)  # the default budget has room for the copies
    assert not model.memory_plan.hold_f32 and model.memory_plan.hold_extra > 0
    assert "'lean' profile is memory first" in caplog.text
    assert _load(path, hold_f32=True)[0].memory_plan.hold_f32
    release = make_checkpoint(tmp_path / "release", "tiny", profile="release")
    assert _load(release)[0].memory_plan.hold_f32


def test_a_session_s_fixed_state_from_a_few_frames_is_the_full_window_s(tiny_q4_ckpt):
    """The pool's state budget (set by default) needs a session's fixed state at start-up:
    measured over a few frames and grown to the encoder's window, it is what a probe
    over the whole window measures (which took minutes at full size on a CPU)."""
    from mlx_voicechat_plugin.runtime.reservation import (
        PROBE_FRAMES,
        Reservations,
        fixed_state_sizes,
    )

    model, processor = _load(tiny_q4_ckpt)
    voicechat = model.create_session(processor)
    window = model.stt_model.perception.att_context[0]
    assert PROBE_FRAMES < window
    full = max(fixed_state_sizes(voicechat, window + 2))
    assert Reservations(voicechat).fixed_bytes() == full
    assert voicechat.fixed_state_bytes == full
