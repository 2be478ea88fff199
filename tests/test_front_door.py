"""The front door, tried as a user makes mistakes: through the real command line.

Nothing is deleted that was not asked for; every ordinary mistake is one line
(``error: ...``, after argparse's usage where it is a flag's value) with exit
code 2 (what was named is wrong) or 1 (the work could not be done), before any
model loads; a bug keeps its traceback; ``serve`` binds its port first, stops
when its model cannot load and says when it is ready; progress shows on a
terminal only.
"""

from __future__ import annotations

import fcntl
import os
import pty
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import wave
from pathlib import Path

import pytest

from mlx_voicechat_plugin.testing.fixtures import make_question_wav

CLI = [sys.executable, "-m", "mlx_voicechat_plugin.cli.main"]
TIMEOUT = 240


@pytest.fixture(scope="module")
def question(tmp_path_factory) -> Path:
    return make_question_wav(tmp_path_factory.mktemp("q") / "q.wav", seconds=1.0)


def _run(*args: str, timeout: int = TIMEOUT, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _one_line(done: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The run ended with ``code`` and one error line holding ``words``, no traceback."""
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, done.stderr
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# --- nothing lost ---------------------------------------------------------------


@pytest.fixture
def models(tiny_ckpt, tmp_path) -> Path:
    """``models/voicechat`` (a checkpoint of this model) beside a user's own file."""
    root = tmp_path / "models"
    shutil.copytree(tiny_ckpt, root / "voicechat")
    (root / "notes.txt").write_text("mine")
    return root


def test_convert_force_into_the_folder_holding_the_source_deletes_nothing(models):
    before = _tree(models)
    done = _run("convert", models / "voicechat", models, "--profile", "lean", "--force")
    _one_line(done, 2, "contains the source")
    assert _tree(models) == before


def test_convert_force_into_a_folder_of_other_files_deletes_nothing(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    done = _run("convert", tiny_ckpt, out, "--force")
    _one_line(done, 2, "not a nemotron_voicechat checkpoint", "nothing was deleted")
    assert (out / "thesis.tex").read_text() == "years of work"


def test_convert_force_into_a_folder_inside_the_source_is_refused(models):
    source = models / "voicechat"
    (source / "old").mkdir()
    before = _tree(models)
    done = _run("convert", source, source / "old", "--force")
    _one_line(done, 2, "inside the source")
    assert _tree(models) == before


def test_convert_force_into_the_source_itself_is_refused(models):
    before = _tree(models)
    _one_line(_run("convert", models / "voicechat", models / "voicechat", "--force"), 2,
              "is the source")
    assert _tree(models) == before


def test_convert_force_into_a_checkpoint_holding_a_user_folder_is_refused(models, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(models / "voicechat", out)
    (out / "recordings").mkdir()
    (out / "recordings" / "a.wav").write_bytes(b"RIFF")
    done = _run("convert", models / "voicechat", out, "--force")
    _one_line(done, 2, "recordings")
    assert (out / "recordings" / "a.wav").is_file()


def test_the_library_convert_keeps_the_same_rule(models):
    from mlx_voicechat_plugin.conversion.convert import convert
    from mlx_voicechat_plugin.conversion.source import ConversionError

    with pytest.raises(ConversionError, match="contains the source"):
        convert(models / "voicechat", models, "lean", force=True, progress=False)
    assert (models / "notes.txt").is_file() and (models / "voicechat" / "config.json").is_file()


def test_output_audio_naming_a_folder_is_one_line_and_nothing_runs(tiny_ckpt, question,
                                                                   tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    done = _run("generate", "-m", tiny_ckpt, "--audio", question, "--output-audio", tmp_path)
    _one_line(done, 2, "--output-audio", "is a folder")
    assert _tree(tmp_path) == ["keep.txt"]
    assert "[user]" not in done.stdout  # refused before the model answered


def test_transcribe_output_path_under_a_file_is_one_line(tiny_ckpt, question, tmp_path):
    (tmp_path / "f").write_text("x")
    done = _run("transcribe", "-m", tiny_ckpt, "--audio", question, "--output-path",
                tmp_path / "f" / "t")
    _one_line(done, 2, "--output-path", "is a file, not a folder")


def test_demo_out_holding_a_foreign_checkpoint_folder_deletes_nothing(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "mine.bin").write_bytes(b"1")
    done = _run("demo", "--out", tmp_path)
    _one_line(done, 2, "--out", "nothing was deleted")
    assert _tree(tmp_path) == ["checkpoint", "checkpoint/mine.bin"]


# --- fail fast, one line ------------------------------------------------------


def test_a_missing_local_path_is_no_such_checkpoint_directory(question):
    for command in ("generate", "transcribe"):
        done = _run(command, "-m", "./models/voicechat", "--audio", question)
        _one_line(done, 2, "no such checkpoint directory: ./models/voicechat")
        assert "Repo id" not in done.stderr and "internet" not in done.stderr


def test_a_truncated_checkpoint_names_the_file(tiny_ckpt, question, tmp_path):
    broken = shutil.copytree(tiny_ckpt, tmp_path / "broken")
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    done = _run("generate", "-m", broken, "--audio", question)
    _one_line(done, 2, "model.safetensors is truncated")


def test_load_tells_a_path_from_a_hub_id_and_names_what_is_missing(tiny_ckpt, tmp_path):
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.checkpoint import CheckpointError, is_hub_id

    for path in ("./nope", "/nope/x", "~/nope", "a/b/c", "nope"):
        assert not is_hub_id(path)
        with pytest.raises(CheckpointError, match=f"no such checkpoint directory: {path}"):
            load(path)
    assert is_hub_id("nvidia/NVIDIA-Nemotron-VoiceChat")
    without = shutil.copytree(tiny_ckpt, tmp_path / "no-config")
    (without / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load(without)
    sharded = shutil.copytree(tiny_ckpt, tmp_path / "no-shard")
    (sharded / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard"):
        load(sharded)


@pytest.mark.parametrize("kind", ["text", "folder", "empty", "missing", "empty-wav"])
def test_audio_that_is_not_audio_is_one_line_before_the_model_loads(tiny_ckpt, tmp_path,
                                                                     kind):
    path = tmp_path / "x.wav"
    if kind == "text":
        path.write_text("hello, this is not audio\n")
    elif kind == "folder":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "empty-wav":
        with wave.open(str(path), "wb") as handle:  # a header and no samples
            handle.setnchannels(1)
            handle.setsampwidth(2)
            handle.setframerate(16000)
    done = _run("generate", "-m", tiny_ckpt, "--audio", path)
    _one_line(done, 2, "--audio", str(path))


def test_serve_port_out_of_range_is_one_line(tiny_ckpt):
    _one_line(_run("serve", "-m", tiny_ckpt, "--port", "99999"), 2, "--port", "99999")


def test_serve_on_a_busy_port_exits_at_once_before_loading(tiny_ckpt):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = _run("serve", "-m", tiny_ckpt, "--port", port, "--no-compile")
    _one_line(done, 1, f"127.0.0.1:{port}", "in use")
    assert "loading" not in done.stderr


def test_serve_with_a_missing_checkpoint_exits_2_at_once():
    done = _run("serve", "-m", "./no/such/ckpt", "--port", "0")
    _one_line(done, 2, "no such checkpoint directory")


def test_serve_whose_model_fails_to_load_exits_1_naming_the_cause(tiny_ckpt):
    done = _run("serve", "-m", tiny_ckpt, "--port", "0", "--no-compile",
                "--memory-budget", "0.00001", timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    failed = [line for line in done.stderr.splitlines() if "failed to load" in line]
    assert len(failed) == 1 and "--memory-budget" in failed[0]


def test_serve_says_when_it_is_ready_with_its_urls(tiny_ckpt):
    server = subprocess.Popen([*CLI, "serve", "-m", str(tiny_ckpt), "--port", "0",
                               "--no-compile"], stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            line = server.stderr.readline()
            if not line:
                break
            lines.append(line)
            if " ready: " in line:
                break
        ready = next(line for line in lines if " ready: " in line)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    assert "ws://127.0.0.1:" in ready and "/v1/realtime" in ready and ":0/" not in ready
    assert any("model loaded" in line for line in lines[: lines.index(ready)])
    assert not any("Uvicorn running" in line for line in lines)


# --- a user's error is one line; a bug its traceback --------------------------------


def test_a_bug_keeps_its_traceback_and_a_user_error_does_not(capsys):
    import numpy as np

    from mlx_voicechat_plugin.cli.common import UsageError, report

    assert report(UsageError("--audio x: no such file")) == 2
    assert capsys.readouterr().err == "error: --audio x: no such file\n"
    try:
        np.zeros(2).reshape(3)
    except ValueError as error:
        with pytest.raises(ValueError, match="reshape"):
            report(error)  # raised deep in a library: a bug, shown whole


# --- host conventions ----------------------------------------------------------


def test_mlx_vlm_generate_output_and_system_keep_their_meaning(tiny_ckpt, question, tmp_path):
    out = tmp_path / "answer.wav"
    done = subprocess.run([sys.executable, "-m", "mlx_vlm.generate", "--model", str(tiny_ckpt),
                           "--audio", str(question), "--output", str(out), "--system", "Be brief.",
                           "--extra-decoding-seconds", "0", "--seed", "1"],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert out.is_file()


def test_mlx_vlm_generate_prompt_is_refused_by_name(tiny_ckpt, question):
    done = subprocess.run([sys.executable, "-m", "mlx_vlm.generate", "--model", str(tiny_ckpt),
                           "--audio", str(question), "--prompt", "hello"],
                          capture_output=True, text=True, timeout=TIMEOUT)
    _one_line(done, 2, "--prompt", "--audio")


def test_temperature_other_than_the_references_is_refused_by_name(tiny_ckpt, question):
    _one_line(_run("generate", "-m", tiny_ckpt, "--audio", question, "--temperature", "0.7"),
              2, "--temperature")
    _one_line(_run("generate", "-m", tiny_ckpt, "--audio", question, "--top-p", "1.5"),
              2, "--top-p")


def test_top_p_reaches_the_speech_head(tiny_ckpt, question):
    done = _run("generate", "-m", tiny_ckpt, "--audio", question, "--top-p", "0.5",
                "--temperature", "0", "--extra-decoding-seconds", "0")
    assert done.returncode == 0, done.stderr


# --- visible work --------------------------------------------------------------------


def _on_a_terminal(args: list[str]) -> tuple[int, str]:
    """Run with standard error on a pseudo-terminal; its exit code and what it showed."""
    master, slave = pty.openpty()
    # 24 rows of 80 columns, as a terminal has (a bare pty is 0 wide: bars draw nothing)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    shown: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    done = subprocess.run([*CLI, *map(str, args)], stdout=subprocess.DEVNULL, stderr=slave,
                          timeout=TIMEOUT)
    os.close(slave)
    reader.join(10)
    os.close(master)
    return done.returncode, b"".join(shown).decode(errors="replace")


def test_progress_shows_on_a_terminal_and_not_with_quiet_or_a_pipe(tiny_ckpt, question):
    argv = ["generate", "-m", tiny_ckpt, "--audio", question, "--extra-decoding-seconds", "1"]
    code, shown = _on_a_terminal(argv)
    assert code == 0, shown
    assert f"loading {tiny_ckpt}" in shown and "answering" in shown and "frame" in shown
    code, shown = _on_a_terminal([*argv, "--quiet"])
    assert code == 0 and "answering" not in shown and "loading" not in shown
    piped = _run(*argv)
    assert piped.returncode == 0 and "answering" not in piped.stderr
    code, shown = _on_a_terminal(["transcribe", "-m", tiny_ckpt, "--audio", question])
    assert code == 0 and "transcribing" in shown and "frame" in shown, shown


# --- the sweep of ordinary mistakes ------------------------------------------------


def _sweep_cases(ckpt: Path, question: Path, tmp: Path) -> list[tuple[list[str], int, str]]:
    (tmp / "notes.txt").write_text("x")
    return [
        ([], 2, "usage"),
        (["gnerate"], 2, "usage"),
        (["generate"], 2, "--model"),
        (["generate", "-m", ckpt], 2, "--audio"),
        (["generate", "-m", ckpt, "--audio", question, "--memory-budget", "-1"], 2,
         "--memory-budget"),
        (["generate", "-m", ckpt, "--audio", question, "--tools-json", tmp / "nope.json"], 2,
         "--tools-json"),
        (["generate", "-m", tmp / "notes.txt", "--audio", question], 2, "is a file"),
        (["generate", "-m", tmp, "--audio", question], 2, "no config.json"),
        (["transcribe", "-m", ckpt, "--audio", question, "--format", "srt"], 2, "--format"),
        (["transcribe", "-m", ckpt, "--audio", question, "--max-tokens", "0"], 2,
         "--max-tokens"),
        (["convert", ckpt, tmp / "o", "--profile", "q3"], 2, "unknown profile 'q3'"),
        (["convert", tmp / "nope", tmp / "o"], 2, "no such checkpoint directory"),
        (["convert", ckpt], 2, "out"),
        (["serve", "-m", ckpt, "--max-sessions", "-1"], 2, "max_sessions"),
        (["serve", "-m", ckpt, "--agent-port", "70000"], 2, "--agent-port"),
        (["serve", "-m", ckpt, "--port", "-5"], 2, "--port"),
        (["compare", ckpt, tmp / "nope", "--audio", question], 2, "no such checkpoint"),
        (["compare", ckpt, ckpt, "--audio", question, "--top-p", "0"], 2, "--top-p"),
        (["compare", ckpt, ckpt, "--audio", question, "--temperature", "1"], 2,
         "--temperature"),
        (["generate", "-m", ckpt, "--audio", question, "-n", "0"], 2, "--max-tokens"),
        (["demo", "--out", tmp / "notes.txt"], 2, "is a file"),
    ]


def test_a_sweep_of_ordinary_mistakes_each_one_line(tiny_ckpt, question, tmp_path):
    for argv, code, word in _sweep_cases(tiny_ckpt, question, tmp_path):
        done = _run(*argv)
        assert done.returncode == code, (argv, done.stderr)
        assert "Traceback" not in done.stderr, (argv, done.stderr)
        text = (done.stdout + done.stderr).lower()
        assert word.lower() in text, (argv, done.stdout, done.stderr)
        errors = [line for line in done.stderr.splitlines() if "error:" in line]
        assert len(errors) <= 1, (argv, done.stderr)


def test_a_read_only_output_folder_is_one_line(tiny_ckpt, question, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    done = _run("generate", "-m", tiny_ckpt, "--audio", question, "--output-audio",
                locked / "a.wav")
    _one_line(done, 2, "not writable")


def test_the_exit_codes_are_documented():
    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    assert "Exit codes" in usage
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "## Troubleshooting" in readme


def test_a_bench_output_naming_a_folder_is_one_line(tmp_path):
    (tmp_path / "keep.json").write_text("{}")
    done = subprocess.run([sys.executable, "-m", "bench.host", "--json", str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=Path(__file__).resolve().parents[1])
    _one_line(done, 2, "--json", "is a folder")
    assert _tree(tmp_path) == ["keep.json"]
