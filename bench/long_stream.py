"""A long synthetic stream through one session: is per-frame cost flat?

    python -m bench.long_stream [--minutes 10] [--size tiny] [--window 250] [--json out.json]

Feeds speech-like signal with pauses in 80 ms frames and reports, per window
of frames, the mean frame time, the resident set size and MLX's active memory.
Per-frame time and memory should stay flat apart from the growth of the
global-attention KV caches (LLM, and the TTS backbone's global layers).
This is a benchmark script, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:  # macOS: peak only
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_stream")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "medium", "full"))
    parser.add_argument("--window", type=int, default=250, help="frames a report row")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint, question_signal

    with tempfile.TemporaryDirectory() as tmp:
        model, processor = load(make_checkpoint(Path(tmp) / args.size, args.size))
    session = model.create_session(processor)
    stream = session.create_streaming_session(seed=0)
    frame = model.config.frame_samples
    phrase = np.concatenate([question_signal(4.0), np.zeros(2 * 16000, np.float32)])
    frames = int(args.minutes * 60 / model.config.frame_duration)
    rows, times = [], []
    print(f"{'frames':>8s} {'minutes':>8s} {'mean_ms':>8s} {'p95_ms':>8s} {'rss_mb':>8s} {'mlx_mb':>8s}")
    for index in range(frames):
        start = (index * frame) % (len(phrase) - frame)
        began = time.perf_counter()
        stream.push_audio(phrase[start : start + frame])
        times.append((time.perf_counter() - began) * 1e3)
        if (index + 1) % args.window == 0:
            row = {
                "frames": index + 1,
                "minutes": (index + 1) * model.config.frame_duration / 60,
                "mean_ms": float(np.mean(times)),
                "p95_ms": float(np.percentile(times, 95)),
                "rss_mb": _rss_mb(),
                "mlx_active_mb": mx.get_active_memory() / 2**20,
            }
            rows.append(row)
            times = []
            print(f"{row['frames']:8d} {row['minutes']:8.2f} {row['mean_ms']:8.2f} "
                  f"{row['p95_ms']:8.2f} {row['rss_mb']:8.1f} {row['mlx_active_mb']:8.1f}", flush=True)
    stream.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
