"""The offline CLI and the hosts' own commands, run as a user would (subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from mlx_voicechat_plugin.hosts.pickup import (
    ENV_SWITCH,
    is_voicechat_checkpoint,
    model_argument,
)
from mlx_voicechat_plugin.testing.fixtures import make_question_wav


@pytest.fixture(scope="module")
def question_wav(tmp_path_factory) -> Path:
    return make_question_wav(tmp_path_factory.mktemp("wav") / "q.wav", seconds=1.0)


def _run(args: list[str], env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _wav_info(path: Path) -> tuple[int, int, int]:
    with wave.open(str(path)) as handle:
        return handle.getframerate(), handle.getnchannels(), handle.getsampwidth()


def test_plugin_cli_answers_and_writes_audio(tiny_ckpt, question_wav, tmp_path):
    out = tmp_path / "a.wav"
    done = _run(["-m", "mlx_voicechat_plugin.cli.main", "generate", "-m", str(tiny_ckpt),
                 "--audio", str(question_wav), "--output-audio", str(out),
                 "--extra-decoding-seconds", "0.5", "--verbose"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[user] ")
    assert "frames/s" in done.stderr and "peak memory" in done.stderr
    assert _wav_info(out) == (22050, 1, 2)


def test_cli_max_tokens_is_the_answer_length_after_the_question(tiny_ckpt, question_wav,
                                                                 tmp_path):
    short, longer = tmp_path / "short.wav", tmp_path / "longer.wav"
    for out, n in ((short, "1"), (longer, "6")):
        done = _run(["-m", "mlx_voicechat_plugin.cli.main", "generate", "-m", str(tiny_ckpt),
                     "--audio", str(question_wav), "-n", n, "--output-audio", str(out)])
        assert done.returncode == 0, done.stderr
    # Five more tokens are five more 80 ms frames of answer (1764 samples each).
    assert out_frames(longer) - out_frames(short) == 5 * 1764


def out_frames(path):
    import wave
    with wave.open(str(path)) as w:
        return w.getnframes()


def test_cli_max_tokens_and_extra_seconds_are_one_choice(tiny_ckpt, question_wav):
    done = _run(["-m", "mlx_voicechat_plugin.cli.main", "generate", "-m", str(tiny_ckpt),
                 "--audio", str(question_wav), "-n", "5", "--extra-decoding-seconds", "1"])
    assert done.returncode == 2
    assert "--max-tokens" in done.stderr and "--extra-decoding-seconds" in done.stderr


@pytest.mark.parametrize("flag", ["--image", "--video"])
def test_cli_rejects_images_and_video(tiny_ckpt, question_wav, flag):
    done = _run(["-m", "mlx_voicechat_plugin.cli.main", "generate", "-m", str(tiny_ckpt),
                 "--audio", str(question_wav), flag, "x.png"])
    assert done.returncode == 2
    assert "speech only" in done.stderr


def test_cli_without_audio_points_to_offline_command(tiny_ckpt):
    done = _run(["-m", "mlx_voicechat_plugin.cli.main", "generate", "-m", str(tiny_ckpt)])
    assert done.returncode == 2
    assert "--audio" in done.stderr and "mlx-voicechat generate" in done.stderr


def test_mlx_vlm_generate_routes_to_plugin(tiny_ckpt, question_wav, tmp_path):
    out = tmp_path / "vlm.wav"
    done = _run(["-m", "mlx_vlm.generate", "--model", str(tiny_ckpt), "--audio", str(question_wav),
                 "--output-audio", str(out), "--max-tokens", "6", "--temperature", "0.0"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[user] ")
    assert out.is_file()


def test_mlx_vlm_interactive_generate_is_refused(tiny_ckpt):
    done = _run(["-m", "mlx_vlm.generate", "--model", str(tiny_ckpt), "--prompt", "hi"])
    assert done.returncode == 2
    assert "--audio" in done.stderr


def test_mlx_audio_sts_generate_routes_to_plugin(tiny_ckpt, question_wav, tmp_path):
    out = tmp_path / "sts.wav"
    done = _run(["-m", "mlx_audio.sts.generate", "--model", str(tiny_ckpt), "--audio",
                 str(question_wav), "--output-path", str(out), "--extra-decoding-seconds", "0"])
    assert done.returncode == 0, done.stderr
    assert out.is_file()


def test_env_switch_turns_routing_off(tiny_ckpt, question_wav):
    done = _run(["-m", "mlx_vlm.generate", "--model", str(tiny_ckpt), "--audio", str(question_wav),
                 "--max-tokens", "1"], env={ENV_SWITCH: "0"})
    # The host's own code runs: it does not print the plugin's transcript line.
    assert not done.stdout.startswith("[user] ")


def test_other_models_are_left_to_the_host(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert not is_voicechat_checkpoint(str(tmp_path))
    assert not is_voicechat_checkpoint("no/such-repo-anywhere")


def test_model_argument_forms():
    assert model_argument(["--model", "a"]) == "a"
    assert model_argument(["-m", "b", "--audio", "x"]) == "b"
    assert model_argument(["--model=c"]) == "c"
    assert model_argument(["--audio", "x"]) is None


def test_voicechat_checkpoint_is_detected(tiny_ckpt):
    assert is_voicechat_checkpoint(str(tiny_ckpt))


def test_cli_stream_prints_text_and_profile(tiny_ckpt, question_wav, tmp_path):
    import json

    out = tmp_path / "s.wav"
    done = _run(["-m", "mlx_voicechat_plugin.cli.main", "generate", "-m", str(tiny_ckpt),
                 "--audio", str(question_wav), "--stream", "--profile", "--output-audio", str(out),
                 "--extra-decoding-seconds", "0.5", "--max-streaming-seconds", "30"])
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["dropped_cold_frames"] == 5 and "host_syncs" in summary
    assert _wav_info(out) == (22050, 1, 2)


def test_pickup_model_type_matches_config():
    from mlx_voicechat_plugin import config
    from mlx_voicechat_plugin.hosts import pickup

    assert pickup.MODEL_TYPE == config.MODEL_TYPE


def test_one_registry_serves_the_cli_and_the_hosts(capsys, monkeypatch):
    from mlx_voicechat_plugin.cli import main as cli
    from mlx_voicechat_plugin.hosts import pickup

    assert cli.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("generate", "serve", "demo"))
    ran = []
    monkeypatch.setattr(cli, "run_command", lambda *a, **k: ran.append((a, k)) or 0)
    assert pickup.run_plugin_command("serve", "python -m mlx_vlm.server", ["--model", "x"]) == 0
    assert ran == [(("serve", ["--model", "x"]), {"prog": "python -m mlx_vlm.server",
                                                   "tolerate_unknown": True, "host": None})]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unknown command"):
        cli.run_command("nope", [])


def test_demo_is_a_subcommand(tmp_path, capsys):
    from mlx_voicechat_plugin.cli.main import run_command

    with pytest.raises(SystemExit) as done:
        run_command("demo", ["--help"])
    assert done.value.code == 0 and "mlx-voicechat demo" in capsys.readouterr().out
