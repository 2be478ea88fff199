"""The console at ``/`` talks to the server over WebRTC from a real (headless) Chromium.

Chromium's fake microphone plays a WAV file (a question, then a pause); the page,
given an ephemeral key minted by the server at ``client_secrets``, makes the call
(``/openai/v1/realtime/calls``) and shows what came back; the model's function head
is scripted to call a tool, which the page answers with its canned answer. The server, Chromium and
their DevTools driver (``console_driver.py``) run in a network namespace of the
test's own where only loopback exists, and the server gathers ICE candidates on
127.0.0.1 only: nothing is sent off loopback. Skipped without Chromium, ``unshare``
or aiortc.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_server_browser import find_chromium

DRIVER = Path(__file__).with_name("console_driver.py")
RUN_TIMEOUT = 240
PNG = b"\x89PNG\r\n\x1a\n"


def namespace_command() -> list[str]:
    """``unshare`` into a network namespace of our own (a user namespace too unless root),
    or a skip with the reason."""
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux's")
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare (util-linux) to run the browser in a loopback-only namespace")
    command = [unshare, "-n"] if os.geteuid() == 0 else [unshare, "-rn"]
    probe = subprocess.run([*command, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()[:200]}")
    return command


def drive_console(checkpoint: Path, out: Path, transport: str = "webrtc") -> tuple[dict, Path]:
    """One call from the page over ``transport``, driven in its namespace: what the page
    showed, and where its files are."""
    if find_chromium() is None:
        pytest.skip("no chromium binary (apt-get install chromium; `make browser` does it in CI)")
    pytest.importorskip("aiortc", reason="the server's calls route needs aiortc (webrtc extra)")
    command = namespace_command()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*command, sys.executable, str(DRIVER), str(checkpoint), str(out),
                           "--transport", transport],
                          cwd=DRIVER.parent, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "result.json").read_text()), out


@pytest.fixture(scope="module")
def console_run(tiny_ckpt, tmp_path_factory) -> tuple[dict, Path]:
    return drive_console(tiny_ckpt, tmp_path_factory.mktemp("console"))


def test_the_page_calls_with_an_ephemeral_key_and_shows_both_sides(console_run):
    seen, _ = console_run
    assert seen["key"] == "ek_"  # the field held the minted key, never the server's
    assert seen["state"] == "ready", seen
    assert seen["errors"] == [], seen["errors"]
    assert seen["transcript"]  # the user's transcript, from the data channel
    assert seen["assistant"]  # the model's words, from the data channel


def test_the_answer_is_heard_and_timed(console_run):
    seen, _ = console_run
    assert seen["peak"] > 0  # the model's Opus track reached the output meter
    assert seen["received"] > 0  # RTP packets in
    assert re.fullmatch(r"-?\d+ ms \((page VAD|speech_stopped)\)", seen["latency"]), seen
    assert seen["turns"] >= 1


def test_the_servers_lateness_is_this_sessions_own_per_turn_and_overall(console_run):
    """From GA's response.done (its voicechat extension), with an ephemeral key that
    /metrics would refuse."""
    seen = console_run[0]["after_finish"]
    late = r"\d+ late of \d+ frames( \(\d+\.\d%\))?(, worst \+[\d.]+ ms)?"
    assert re.fullmatch(late + ", this session", seen["lateness"]), seen["lateness"]
    assert any(re.fullmatch(late, pace) for pace in seen["paces"]), seen["paces"]


def test_the_tool_call_is_shown_answered_and_acknowledged(console_run):
    seen, _ = console_run  # the model's function head is scripted to call get_weather
    (call,) = seen["calls"]
    assert call["title"].startswith("get_weather (call_")
    assert json.loads(call["args"]) == {"city": "Paris"}
    assert '"forecast":"sunny"' in call["ack"]  # the canned answer went out
    assert re.search(r"acknowledged: item_\w+ \(function_call_output\)", call["ack"])
    assert seen["function"] == 'get_weather({"city": "Paris"})'  # the function channel


def test_finish_gets_its_answer_then_hangs_up_and_the_session_is_released(console_run):
    seen, _ = console_run
    after = seen["after_finish"]
    assert after["state"] == "done", after  # the response Finish asked for was done
    assert after["errors"] == [], after["errors"]  # the hang-up (DELETE) was accepted
    assert seen["released"]


def test_a_screenshot_is_saved(console_run):
    _, out = console_run
    assert (out / "console.png").read_bytes()[:8] == PNG
