"""``python -m conformance.wire``: our server's events against the reference server's.

The same scripted conversation runs through the reference endpoint and ours;
every event of a kind the reference has must match it in type, keys, JSON
types and values, and our audio must equal the offline decode of its codes.
"""

from __future__ import annotations

import copy

import pytest

from conformance.wire import REFERENCE_KINDS, diff_events, main, our_events, reference_events, \
    run_wire, script
from mlx_voicechat_plugin.testing.fixtures import make_question_wav, question_signal

PROMPT = "Be brief."
RUNS = {
    "tiny": ("tiny", None, False),
    "tiny-prompt": ("tiny", PROMPT, False),
    "tiny-cancel": ("tiny", None, True),
    "small": ("small", None, False),
    "small-prompt": ("small", PROMPT, False),
}


@pytest.fixture(scope="module")
def wav(tmp_path_factory):
    return make_question_wav(tmp_path_factory.mktemp("wire") / "q.wav", seconds=1.0)


@pytest.fixture(scope="module")
def results(request, wav, tiny_ckpt, small_ckpt):
    checkpoints = {"tiny": tiny_ckpt, "small": small_ckpt}
    return {name: run_wire(checkpoints[size], wav, system_prompt=prompt, cancel=cancel)
            for name, (size, prompt, cancel) in RUNS.items()}


@pytest.mark.parametrize("run", list(RUNS))
def test_wire_matches_the_reference(results, run):
    result = results[run]
    assert result.ok, result.report()
    assert result.audio_frames > 0 and result.audio_vs_offline_max_abs == 0.0


@pytest.mark.parametrize("kind", REFERENCE_KINDS)
def test_each_reference_event_kind_is_matched(results, kind):
    assert sum(r.kinds[kind] for r in results.values()) > 0, kind


def test_codec_divergence_is_reported_not_failed(results):
    result = results["tiny"]
    assert result.audio_reference_lag > 0  # the reference streams late (README #4)


@pytest.fixture(scope="module")
def pair_events(tiny_ckpt):
    messages = script(question_signal(0.5), str(tiny_ckpt), system_prompt=None, seed=0,
                      chunk=4000, cancel=False)
    return our_events(str(tiny_ckpt), messages), reference_events(messages)


@pytest.mark.parametrize("mutation", ["audio-field", "transcript-field", "tail-event",
                                      "int-as-str", "missing-event"])
def test_the_diff_fails_on_the_old_wire_mistakes(pair_events, mutation):
    ours, theirs = copy.deepcopy(pair_events[0]), pair_events[1]
    assert diff_events(ours, theirs).ok
    audio = [e for e in ours if e["type"] == "response.audio.delta"]
    heard = [e for e in ours if e["type"] == "conversation.item.input_audio_transcription.delta"]
    if mutation == "audio-field":
        audio[0]["audio"] = audio[0].pop("delta")
    elif mutation == "transcript-field":
        heard[0]["text"] = heard[0].pop("transcript")
    elif mutation == "tail-event":
        tail = dict(audio[-1], audio_codes=[])
        ours.insert(ours.index(audio[-1]) + 1, tail)
    elif mutation == "int-as-str":
        audio[1]["frame_index"] = str(audio[1]["frame_index"])
    else:
        ours.remove(audio[2])
    assert not diff_events(ours, theirs).ok


def test_cli_exits_zero_and_prints_the_table(tiny_ckpt, wav, capsys):
    assert main([str(tiny_ckpt), str(wav), "--chunk", "1280"]) == 0
    out = capsys.readouterr().out
    assert "response.audio.delta" in out and "MISMATCH" not in out
