"""Soak: many sequential realtime sessions on the tiny fixture via the real server.

Reports resident memory, thread count and open file descriptors at the start,
the middle and the end. ``python -m bench.soak --sessions 200``.
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


def resources() -> dict[str, float]:
    rss_kib = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return {"rss_mib": rss_kib / 1024, "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd"))}


def one_session(server, frames: int = FRAMES_PER_SESSION) -> int:
    from server_support import FRAME, append_message, configure, connect, send, until_closed

    server.wait_idle()
    with connect(server.ws()) as ws:
        configure(ws)
        send(ws, append_message(np.zeros(frames * FRAME, np.float32)))
        send(ws, {"type": "input_audio_buffer.commit"})
        events, code = until_closed(ws)
    assert code == 1000, code
    return sum(e["type"] == "response.audio.delta" for e in events)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=200)
    args = parser.parse_args(argv)
    from server_support import LiveServer

    from mlx_voicechat_plugin.server.app import create_app
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "tiny", "tiny")
        server = LiveServer(create_app(ckpt))
        try:
            marks = {0: "start", args.sessions // 2: "middle", args.sessions: "end"}
            one_session(server)  # warm-up: first-use allocations are not a leak
            for done in range(args.sessions + 1):
                if done in marks:
                    figures = resources()
                    print(f"{marks[done]:>6} after {done:4d} sessions: "
                          f"rss {figures['rss_mib']:.1f} MiB, threads {figures['threads']}, "
                          f"fds {figures['fds']}", flush=True)
                if done < args.sessions:
                    one_session(server)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
