"""The examples are part of the product: each runs as a user runs it, a subprocess against
a freshly started ``mlx-voicechat serve``, on a short question and on a long input.

The first session on a fresh server waits for its first prefill (seconds): a client that
gives up after a quiet second writes an empty answer. A long input sends far more than
the sockets hold: a client that does not read while it sends never finishes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_support import ServerProcess

from mlx_voicechat_plugin.runtime.audio import write_wav
from mlx_voicechat_plugin.testing.fixtures import conversation_signal, make_question_wav

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
API_KEY = "local-key"
# 750 frames, some 2.6 MB of appends: past what loopback's socket buffers take, so a
# client that sends it all before it reads stalls and fails. Keep it long: a 40 s input
# fits in the buffers, and such a client passes it (see the commit).
LONG_SECONDS = 60.0
RUN_TIMEOUT = 420


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wavs")
    long = folder / "long.wav"
    write_wav(long, conversation_signal(LONG_SECONDS), 16_000)
    return make_question_wav(folder / "question.wav", seconds=2.0), long


def _fresh_server(ckpt: Path, folder: Path) -> ServerProcess:
    return ServerProcess("mlx_voicechat_plugin.cli.main",
                         ["serve", "-m", str(ckpt), "--no-compile", "--api-key", API_KEY],
                         folder / "serve.log")


def _run(example: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / example), *args, "--api-key", API_KEY],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)


def _answer_seconds(output: str) -> float:
    found = re.search(r"wrote .*?\(?([0-9.]+) s", output)
    assert found, output
    return float(found.group(1))


def test_the_openai_sdk_client_waits_for_the_answer_on_a_fresh_server(tiny_ckpt, wavs,
                                                                      tmp_path):
    pytest.importorskip("openai")
    question, long = wavs
    server = _fresh_server(tiny_ckpt, tmp_path)
    try:
        base = server.http("/openai/v1")
        for wav in (question, long):
            done = _run("openai_sdk_client.py", base, str(wav), str(tmp_path / "answer.wav"))
            assert done.returncode == 0, done.stderr + done.stdout
            assert _answer_seconds(done.stdout) > 0, done.stdout
    finally:
        server.stop()


def test_the_file_and_tool_clients_read_while_they_send_on_a_fresh_server(tiny_ckpt, wavs,
                                                                        tmp_path):
    question, long = wavs
    server = _fresh_server(tiny_ckpt, tmp_path)
    try:
        for wav, seconds in ((question, 2.0), (long, LONG_SECONDS)):
            done = _run("file_client.py", server.ws(), str(wav), str(tmp_path / "answer.wav"))
            assert done.returncode == 0, done.stderr + done.stdout
            assert "[user]" in done.stdout
            assert _answer_seconds(done.stderr) >= seconds  # an answer frame for each frame
        done = _run("tool_client.py", server.ws(), str(long), str(tmp_path / "tools.wav"))
        assert done.returncode == 0, done.stderr + done.stdout
        assert "bookings:" in done.stdout
        # A refusal is one line and exit status 1 (a system prompt over the server's bound).
        done = _run("file_client.py", server.ws(), str(question), str(tmp_path / "a.wav"),
                    "--system-prompt", "x" * 100_000)
        assert done.returncode == 1
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    finally:
        server.stop()
