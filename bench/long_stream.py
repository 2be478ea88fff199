"""A long synthetic stream through one session: are state and per-frame cost flat?

    python -m bench.long_stream [--minutes 60] [--context-seconds 120]
        [--unbounded-minutes 10] [--size tiny] [--json out.json]

Feeds speech-like signal with pauses in 80 ms frames, unpaced, through one
streaming session with a bounded context (``--context-seconds``), then
through one without (``context_seconds=0``, the reference's growing caches;
``--unbounded-minutes``, 0 skips it), and reports per minute of audio: the
session's state bytes (its arrays' ``nbytes``) at the minute's end and the
step time (p50, p95, mean of ``push_audio`` per frame), with the resident
set size and MLX's active memory. The summary compares minute 3 with the
last minute of the bounded run (state bytes equal, p50 within 10%), and the
unbounded run's measured growth per minute with the one computed from the
config (:func:`~mlx_voicechat_plugin.runtime.reservation.minute_bytes`).
The load average is recorded at the start and the end (the machine may be
shared). This is a benchmark script, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from . import check_output


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:  # macOS: peak only
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(session, config, minutes: float, context_seconds: float, label: str) -> list[dict]:
    """One session over ``minutes`` of audio; a row per minute."""
    from mlx_voicechat_plugin.testing.fixtures import question_signal

    stream = session.create_streaming_session(seed=0, context_seconds=context_seconds)
    frame = config.frame_samples
    per_minute = round(60 / config.frame_duration)
    phrase = np.concatenate([question_signal(4.0), np.zeros(2 * 16000, np.float32)])
    frames = round(minutes * per_minute)
    rows, times = [], []
    print(f"\n{label}: context_seconds={context_seconds:g}, {minutes:g} min "
          f"({frames} frames), load {_loadavg()}")
    print(f"{'minute':>6s} {'state_bytes':>12s} {'p50_ms':>8s} {'p95_ms':>8s} {'mean_ms':>8s} "
          f"{'rss_mb':>8s} {'mlx_mb':>8s}")
    for index in range(frames):
        start = (index * frame) % (len(phrase) - frame)
        began = time.perf_counter()
        stream.push_audio(phrase[start : start + frame])
        times.append((time.perf_counter() - began) * 1e3)
        if (index + 1) % per_minute == 0:
            row = {
                "mode": label,
                "minute": (index + 1) // per_minute,
                "state_bytes": stream.nbytes,
                "p50_ms": float(np.percentile(times, 50)),
                "p95_ms": float(np.percentile(times, 95)),
                "mean_ms": float(np.mean(times)),
                "rss_mb": _rss_mb(),
                "mlx_active_mb": mx.get_active_memory() / 2**20,
            }
            rows.append(row)
            times = []
            print(f"{row['minute']:6d} {row['state_bytes']:12d} {row['p50_ms']:8.2f} "
                  f"{row['p95_ms']:8.2f} {row['mean_ms']:8.2f} {row['rss_mb']:8.1f} "
                  f"{row['mlx_active_mb']:8.1f}", flush=True)
    stream.cancel()
    return rows


def summary(bounded: list[dict], unbounded: list[dict], config, warm: int) -> dict:
    from mlx_voicechat_plugin.runtime.reservation import minute_bytes

    out: dict = {}
    if len(bounded) >= 3:
        third, last = bounded[2], bounded[-1]
        out["bounded"] = {
            "minute_3": {"state_bytes": third["state_bytes"], "p50_ms": third["p50_ms"]},
            f"minute_{last['minute']}": {"state_bytes": last["state_bytes"],
                                         "p50_ms": last["p50_ms"]},
            "state_equal": third["state_bytes"] == last["state_bytes"],
            "p50_ratio": last["p50_ms"] / third["p50_ms"],
        }
    if len(unbounded) >= 3:
        # From minute 2 on: minute 1 also fills the encoder's 70-frame windows.
        growth = [b["state_bytes"] - a["state_bytes"] for a, b in zip(unbounded[1:], unbounded[2:])]
        out["unbounded"] = {
            "measured_bytes_per_minute": growth,
            "computed_bytes_per_minute": [minute_bytes(config, row["minute"], warm)
                                          for row in unbounded[2:]],
            "p50_ratio_last_to_2": unbounded[-1]["p50_ms"] / unbounded[1]["p50_ms"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_stream")
    parser.add_argument("--minutes", type=float, default=60.0, help="of the bounded session")
    parser.add_argument("--context-seconds", type=float, default=120.0)
    parser.add_argument("--unbounded-minutes", type=float, default=None,
                        help="of the unbounded session (default: --minutes; 0: skip it)")
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "medium", "full"))
    parser.add_argument("--json", help="write the rows and the summary here")
    args = parser.parse_args(argv)
    check_output(parser, args.json, "--json")

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model, processor = load(make_checkpoint(Path(tmp) / args.size, args.size))
    session = model.create_session(processor)
    config = model.config
    load_start = _loadavg()
    bounded = run(session, config, args.minutes, args.context_seconds, "bounded")
    minutes = args.minutes if args.unbounded_minutes is None else args.unbounded_minutes
    unbounded = run(session, config, minutes, 0.0, "unbounded") if minutes else []
    result = {"size": args.size, "context_seconds": args.context_seconds,
              "loadavg_start": load_start, "loadavg_end": _loadavg(),
              "summary": summary(bounded, unbounded, config, session.warm_start.positions),
              "rows": bounded + unbounded}
    print("\n" + json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
