"""mlx-audio's STT command (and ``mlx-voicechat transcribe``) run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_voicechat_plugin.hosts.pickup import ENV_SWITCH, HOST_COMMANDS
from mlx_voicechat_plugin.testing.fixtures import make_question_wav


@pytest.fixture(scope="module")
def question_wav(tmp_path_factory) -> Path:
    return make_question_wav(tmp_path_factory.mktemp("wav") / "q.wav", seconds=1.0)


@pytest.fixture(scope="module")
def transcript(tiny_ckpt, question_wav) -> str:
    """The transcript a full offline ``generate`` with no extra decoding seconds reports for
    the question (the command transcribes the file with nothing appended)."""
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    text = model.create_session(processor).generate(
        str(question_wav), extra_decoding_seconds=0.0).user_transcript
    assert text
    return text


def _run(args: list[str], env: dict | None = None, cwd: Path | None = None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def test_the_stt_command_routes_to_the_plugin(tiny_ckpt):
    assert HOST_COMMANDS["mlx_audio.stt.generate"][0] == "transcribe"


def test_mlx_audio_stt_generate_prints_the_transcript(tiny_ckpt, question_wav, transcript):
    done = _run(["-m", "mlx_audio.stt.generate", "--model", str(tiny_ckpt),
                 "--audio", str(question_wav)])
    assert done.returncode == 0, done.stderr
    assert done.stdout == transcript + "\n"


def test_output_path_writes_txt_and_json_like_mlx_audio(tiny_ckpt, question_wav, transcript,
                                                         tmp_path):
    base = tmp_path / "out" / "t"
    done = _run(["-m", "mlx_audio.stt.generate", "--model", str(tiny_ckpt), "--audio",
                 str(question_wav), "--output-path", str(base), "--format", "txt"])
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "t.txt").read_text() == transcript + "\n"
    done = _run(["-m", "mlx_audio.stt.generate", "--model", str(tiny_ckpt), "--audio",
                 str(question_wav), "--output-path", str(base), "--format", "json"])
    assert done.returncode == 0, done.stderr
    payload = json.loads((tmp_path / "out" / "t.json").read_text())
    assert payload["text"] == transcript and payload["language"] == "en"
    assert payload["duration"] == pytest.approx(1.0)


def test_json_to_standard_output_and_host_flags_are_tolerated(tiny_ckpt, question_wav,
                                                               transcript):
    done = _run(["-m", "mlx_audio.stt.generate", "--model", str(tiny_ckpt), "--audio",
                 str(question_wav), "--output-path", "-", "--format", "json",
                 "--chunk-duration", "30", "--verbose"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["text"] == transcript
    assert "ignoring options" in done.stderr and "real time" in done.stderr


def test_stream_prints_the_same_transcript(tiny_ckpt, question_wav, transcript):
    done = _run(["-m", "mlx_audio.stt.generate", "--model", str(tiny_ckpt), "--audio",
                 str(question_wav), "--stream"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == transcript


def test_max_tokens_bounds_the_transcript(tiny_ckpt, question_wav, transcript):
    done = _run(["-m", "mlx_voicechat_plugin.cli.main", "transcribe", "-m", str(tiny_ckpt),
                 "--audio", str(question_wav), "--max-tokens", "2"])
    assert done.returncode == 0, done.stderr
    assert transcript.startswith(done.stdout.strip()) and done.stdout.strip() != transcript


@pytest.mark.parametrize("args, words", [
    (["--format", "srt"], "--format must be txt or json"),
    (["--language", "fr"], "--language must be 'auto' or 'en'"),
    (["--max-tokens", "0"], "--max-tokens must be a positive integer"),
])
def test_bad_flags_are_refused_naming_the_flag(tiny_ckpt, question_wav, args, words):
    done = _run(["-m", "mlx_audio.stt.generate", "--model", str(tiny_ckpt), "--audio",
                 str(question_wav), *args])
    assert done.returncode == 2
    assert words in done.stderr


def test_a_missing_audio_file_is_an_error(tiny_ckpt, tmp_path):
    done = _run(["-m", "mlx_audio.stt.generate", "--model", str(tiny_ckpt), "--audio",
                 str(tmp_path / "none.wav")])
    assert done.returncode == 2 and "not found" in done.stderr


def test_the_env_switch_leaves_the_host_command_alone(tiny_ckpt, question_wav, transcript):
    done = _run(["-m", "mlx_audio.stt.generate", "--model", str(tiny_ckpt), "--audio",
                 str(question_wav), "--output-path", "-"], env={ENV_SWITCH: "0"})
    # The host's own code runs: it does not print the plugin's transcript.
    assert transcript not in done.stdout
