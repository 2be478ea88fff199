"""Soak: many realtime sessions on the tiny fixture via the real server.

Reports resident memory, thread count and open file descriptors at the start,
the middle and the end. ``python -m bench.soak --sessions 200`` runs them one
after another; ``--concurrency 4`` runs them 4 at a time on a server started
with ``--max-sessions 4``. ``--resume-cycles 200`` instead drops a session's
connection (a reset, no close frame) and resumes it 200 times,
:data:`CYCLES_PER_SESSION` to a session (issue 42). ``--drop-cycles 200``
opens sessions from one key and drops each (a reset: half of them configured
and fed audio, half never configured) on the default one-slot server, each
next one taking the slot, and reports how long each newcomer waited to be
admitted after the drop (issue 51).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

FRAMES_PER_SESSION = 3
CYCLES_PER_SESSION = 10


def resources() -> dict[str, float]:
    rss_kib = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return {"rss_mib": rss_kib / 1024, "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd"))}


def one_session(server, frames: int = FRAMES_PER_SESSION, wait_idle: bool = True) -> int:
    from server_support import FRAME, append_message, configure, connect, send, until_closed

    if wait_idle:
        server.wait_idle()
    with connect(server.ws()) as ws:
        configure(ws)
        send(ws, append_message(np.zeros(frames * FRAME, np.float32)))
        send(ws, {"type": "input_audio_buffer.commit"})
        events, code = until_closed(ws)
    assert code == 1000, code
    return sum(e["type"] == "response.audio.delta" for e in events)


def resumed_session(server, cycles: int = CYCLES_PER_SESSION) -> int:
    """One session whose connection drops and is resumed ``cycles`` times, a frame of
    audio each time; then committed. The events replayed in all."""
    from raw_client import RawClient
    from resume_support import abort, event, reattach, resume_path
    from server_support import FRAME, append_message

    client = RawClient(server.port)
    token = event(client)["session"]["resume_token"]
    client.send_json({"type": "session.update", "session": {}})
    last_seq, replayed = event(client)["seq"], 0
    for _ in range(cycles):
        client.send_json(append_message(np.zeros(FRAME, np.float32)))
        abort(client)
        client = reattach(server.port, resume_path("/v1/realtime", token, last_seq))
        resumed = event(client)
        assert resumed["type"] == "session.resumed", resumed
        replayed += resumed["replayed"]
        client.send_json({"type": "session.ping"})
        while (got := event(client))["type"] != "session.pong":
            pass
        last_seq = got["seq"]
    client.send_json({"type": "input_audio_buffer.commit"})
    while event(client)["type"] != "response.done":
        pass
    client.close()
    return replayed


def dropped_session(server, configured: bool) -> float:
    """Open a session (configured and fed audio, or not), drop it (a reset), and return
    the seconds until the next connection was admitted (it is then closed cleanly)."""
    import struct
    import time

    from raw_client import RawClient
    from resume_support import abort, event
    from server_support import FRAME, append_message

    client = RawClient(server.port)
    assert event(client)["type"] == "session.created"
    if configured:
        client.send_json({"type": "session.update", "session": {}})
        while event(client)["type"] != "session.updated":
            pass
        client.send_json(append_message(np.zeros(2 * FRAME, np.float32)))
    abort(client)
    dropped = time.monotonic()
    while True:
        newcomer = RawClient(server.port)
        if event(newcomer)["type"] == "session.created":
            waited = time.monotonic() - dropped
            newcomer.send_frame(struct.pack("!H", 1000), opcode=0x8)
            newcomer.close_frame()
            newcomer.close()
            return waited
        newcomer.close()
        time.sleep(0.01)


def drop_storm(server, cycles: int) -> int:
    """``cycles`` open-and-drop cycles; the figures at the start, middle and end, and the
    longest wait for the slot."""
    dropped_session(server, True)  # warm-up
    report("start", 0, "open-and-drop cycles")
    waits = []
    for done in range(1, cycles + 1):
        waits.append(dropped_session(server, configured=bool(done % 2)))
        if done == cycles // 2:
            report("middle", done, "open-and-drop cycles")
    server.wait_idle()
    report("end", cycles, "open-and-drop cycles")
    print(f"newcomer admitted after a drop: median {np.median(waits) * 1000:.1f} ms, "
          f"longest {max(waits) * 1000:.1f} ms ({cycles} drops)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="sessions at a time (the server gets --max-sessions this)")
    parser.add_argument("--resume-cycles", type=int, default=0,
                        help="drop-and-resume cycles instead of sessions "
                             f"({CYCLES_PER_SESSION} to a session)")
    parser.add_argument("--drop-cycles", type=int, default=0,
                        help="open-and-drop cycles on the default one-slot server instead")
    args = parser.parse_args(argv)
    from concurrent.futures import ThreadPoolExecutor

    from server_support import LiveServer

    from mlx_voicechat_plugin.server.app import create_app
    from mlx_voicechat_plugin.server.limits import ServerLimits
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint

    at_once = args.concurrency
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "tiny", "tiny")
        server = LiveServer(create_app(ckpt, limits=ServerLimits(max_sessions=at_once)))
        try:
            if args.resume_cycles:
                return resume_storm(server, args.resume_cycles)
            if args.drop_cycles:
                return drop_storm(server, args.drop_cycles)
            marks = {0: "start", args.sessions // 2: "middle", args.sessions: "end"}
            one_session(server)  # warm-up: first-use allocations are not a leak
            done = 0
            with ThreadPoolExecutor(at_once) as workers:
                while True:
                    for mark in [m for m in sorted(marks) if m <= done]:
                        figures = resources()
                        print(f"{marks.pop(mark):>6} after {done:4d} sessions "
                              f"({at_once} at a time): rss {figures['rss_mib']:.1f} MiB, "
                              f"threads {figures['threads']}, fds {figures['fds']}", flush=True)
                    if done >= args.sessions:
                        break
                    batch = min(at_once, args.sessions - done)
                    # Each wave fills every slot; the next starts once all have left.
                    list(workers.map(lambda _: one_session(server, wait_idle=False), range(batch)))
                    server.wait_idle()
                    done += batch
        finally:
            server.stop()
    return 0


def report(mark: str, done: int, what: str) -> None:
    figures = resources()
    print(f"{mark:>6} after {done:4d} {what}: rss {figures['rss_mib']:.1f} MiB, "
          f"threads {figures['threads']}, fds {figures['fds']}", flush=True)


def resume_storm(server, cycles: int) -> int:
    """``cycles`` drop-and-resume cycles; the figures at the start, middle and end."""
    resumed_session(server, 1)  # warm-up
    server.wait_idle()
    sessions = max(cycles // CYCLES_PER_SESSION, 1)
    report("start", 0, "drop-and-resume cycles")
    for done in range(1, sessions + 1):
        resumed_session(server)
        server.wait_idle()
        if done == sessions // 2:
            report("middle", done * CYCLES_PER_SESSION, "drop-and-resume cycles")
    report("end", sessions * CYCLES_PER_SESSION, "drop-and-resume cycles")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: MLX's per-thread stream state, made by the
    # engine thread, is sometimes destroyed while its worker is joinable at
    # exit ("terminate called without an active exception", exit 134), which
    # would fail `make soak` after every figure has been printed.
    os._exit(code)
