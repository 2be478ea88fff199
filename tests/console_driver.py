"""Drives the console page at ``/`` in headless Chromium against a server of its own, and
writes what the page showed (``result.json``) and a screenshot (``console.png``).

Run by ``tests/test_console_webrtc.py`` as a subprocess inside a network namespace of
its own (``unshare -n``) where only loopback exists: it brings ``lo`` up, serves the
tiny checkpoint on 127.0.0.1 with ``--api-key`` (ICE candidates on 127.0.0.1 only),
mints an ephemeral key at ``client_secrets`` as a backend would, gives it to the
page's key field and lets Chromium's fake microphone (a WAV file) talk over WebRTC;
the model's function head is scripted to call ``get_weather``, which the driver
answers with the page's canned-answer button.

    python tests/console_driver.py CHECKPOINT OUT_DIR [--transport webrtc|websocket]
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import socket
import struct
import sys
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
from ga_support import GA_RATE, scripted_call
from server_support import LiveServer
from test_server_browser import browser_page, find_chromium

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.transport.ice import ICEConfig
from mlx_voicechat_plugin.testing.fixtures import question_signal

KEY = "console-server-key"
QUESTION_SECONDS = 1.5
PAUSE_SECONDS = 2.5  # silence after the question (the fake microphone loops the file)
TALK_TIMEOUT = 90.0
# Chromium's fake microphone plays the WAV; WebRTC may use loopback candidates.
FLAGS = ("--allow-loopback-in-peer-connection", "--window-size=1280,1400")
SNAPSHOT = """(() => {
  const text = (id) => document.getElementById(id).textContent;
  return {state: document.body.dataset.state, status: text('status'),
          transcript: text('transcript'), assistant: text('assistant'),
          peak: +text('level-out-peak'), latency: text('latency'),
          turns: document.getElementById('turns').childElementCount,
          paces: [...document.querySelectorAll('#turns tr')].map((tr) => tr.lastChild.textContent),
          lateness: text('lateness'), rtc: text('rtc-stats'),
          sent: +text('sent'), received: +text('received'),
          errors: [...document.querySelectorAll('#errors li')].map((li) => li.textContent),
          calls: [...document.querySelectorAll('#calls li')].map((li) => ({
            title: li.querySelector('.call-title').textContent,
            args: li.querySelector('.call-args').textContent,
            ack: li.querySelector('.call-ack').textContent})),
          function: text('function'),
          key: document.getElementById('key').value.slice(0, 3)};
})()"""
TALKED = ("(() => { const t = (id) => document.getElementById(id).textContent;"
          " return t('transcript') !== '' && t('assistant') !== ''"
          " && +t('level-out-peak') > 0 && /ms/.test(t('latency'))"
          " && !!document.querySelector('#calls li.acked'); })()")
# The model's scripted tool call, once its arguments are in: answered with the canned button.
ANSWER = ("(() => { const call = document.querySelector('#calls li:not(.answered)');"
          " if (!call || !/your answer/.test(call.querySelector('.call-ack').textContent))"
          " return false; call.querySelector('.call-canned').click(); return true; })()")


def loopback_up() -> None:
    """``ip link set lo up`` without iproute2: the SIOCSIFFLAGS ioctl."""
    get_flags, set_flags, up = 0x8913, 0x8914, 0x1  # SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh14s", b"lo", 0, b"")
        flags = struct.unpack("16sh14s", fcntl.ioctl(sock, get_flags, request))[1]
        fcntl.ioctl(sock, set_flags, struct.pack("16sh14s", b"lo", flags | up, b""))


def question_wav(path: Path) -> Path:
    """The fixtures' question signal, then a pause, as a 24 kHz PCM16 WAV file."""
    import soxr

    speech = soxr.resample(question_signal(QUESTION_SECONDS), 16_000, GA_RATE)
    samples = np.concatenate([speech, np.zeros(int(PAUSE_SECONDS * GA_RATE), np.float32)])
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(GA_RATE)
        out.writeframes(np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def mint(live: LiveServer) -> str:
    """An ephemeral key, minted with the server's key (what a page's backend does)."""
    response = httpx.post(live.http("/openai/v1/realtime/client_secrets"),
                          headers={"Authorization": f"Bearer {KEY}"}, json={}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["value"]


def drive(checkpoint: Path, out: Path, transport: str) -> dict:
    live = LiveServer(create_app(checkpoint, api_key=KEY, ice=ICEConfig(hosts=("127.0.0.1",))),
                      wait_ready=False)
    patch = pytest.MonkeyPatch()
    try:
        live.wait_health(200)
        scripted_call(live, patch)  # the model calls get_weather early in the call
        key = mint(live) if transport == "webrtc" else KEY
        wav = question_wav(out / "question.wav")
        flags = (*FLAGS, f"--use-file-for-fake-audio-capture={wav}")
        with browser_page(find_chromium(), live, out / "profile", transport, flags) as page:
            page.evaluate(f"document.getElementById('key').value = {key!r}")
            page.evaluate("document.getElementById('start').click()")
            page.wait_for("['ready', 'error', 'closed'].includes(document.body.dataset.state)",
                          TALK_TIMEOUT)
            if page.evaluate("document.body.dataset.state") == "ready":
                deadline = time.monotonic() + TALK_TIMEOUT
                while not page.evaluate(TALKED) and time.monotonic() < deadline:
                    page.evaluate(ANSWER)
                    time.sleep(0.2)
            seen = page.evaluate(SNAPSHOT)
            shot = page.command("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            (out / "console.png").write_bytes(base64.b64decode(shot["data"]))
            # Finish: commit, ask for an answer, hang up once it is done.
            page.evaluate("document.getElementById('stop').click()")
            page.wait_for("document.getElementById('start').disabled === false", TALK_TIMEOUT)
            seen["after_finish"] = page.evaluate(SNAPSHOT)
        live.wait_idle()  # the call's session was released
        seen["released"] = True
        return seen
    finally:
        live.stop()
        patch.undo()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--transport", default="webrtc", choices=("webrtc", "websocket"))
    parser.add_argument("--no-loopback-up", action="store_true",
                        help="lo is up already (not in a namespace of our own)")
    args = parser.parse_args(argv)
    if not args.no_loopback_up:
        loopback_up()
    args.out.mkdir(parents=True, exist_ok=True)
    result = drive(args.checkpoint, args.out, args.transport)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
