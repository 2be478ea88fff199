"""A question answered end to end, as a user waits for it: each side in a fresh process.

    python -m bench.end_to_end --size medium [--seconds 3] [--runs 3]

For each run and each side (plugin, reference), a new Python process loads
the fixture checkpoint (timed apart, excluded from the figure), then times
session start, every 80 ms frame of a ``--seconds`` question streamed in
real-time-sized chunks, and the flush: the first frame pays the
per-process compile tracing, exactly as a user's first answer does. The
sides alternate, and the median of the runs is reported with its spread.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _child(side: str, checkpoint: str, seconds: float) -> dict:
    import mlx.core as mx

    from mlx_voicechat_plugin.testing.fixtures import question_signal

    began = time.perf_counter()
    if side == "plugin":
        from mlx_voicechat_plugin import load

        model, processor = load(checkpoint)
        wrap = lambda x: x  # noqa: E731
    else:
        from mlx_vlm.utils import load

        model, processor = load(checkpoint)
        wrap = mx.array
    session = model.create_session(processor)
    loaded = time.perf_counter()
    stream = session.create_streaming_session()
    started = time.perf_counter()
    audio = question_signal(seconds)
    frame = stream.frame_samples
    first_frame = None
    for start in range(0, len(audio) - frame + 1, frame):
        stream.push_audio(wrap(audio[start : start + frame]))
        if first_frame is None:
            first_frame = time.perf_counter() - started
    stream.flush()
    done = time.perf_counter()
    return {"load_s": loaded - began, "session_start_s": started - loaded,
            "first_frame_s": first_frame, "answer_s": done - loaded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.end_to_end")
    parser.add_argument("--size", default="medium", choices=("tiny", "small", "medium", "full"))
    parser.add_argument("--seconds", type=float, default=3.0, help="question length")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], args.seconds)))
        return 0

    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint

    tmp = tempfile.TemporaryDirectory()
    checkpoint = str(make_checkpoint(Path(tmp.name) / args.size, args.size))
    results: dict[str, list[dict]] = {"plugin": [], "reference": []}
    for run in range(args.runs):
        for side in ("plugin", "reference") if run % 2 == 0 else ("reference", "plugin"):
            out = subprocess.run(
                [sys.executable, "-m", "bench.end_to_end", "--seconds", str(args.seconds),
                 "--child", side, checkpoint], capture_output=True, text=True, check=True)
            results[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(side, results[side][-1], flush=True)
    ratios = [p["answer_s"] / r["answer_s"] for p, r in zip(results["plugin"], results["reference"])]
    summary = {
        side: {key: float(np.median([r[key] for r in runs])) for key in runs[0]}
        for side, runs in results.items()
    }
    summary["ratio_answer_median"] = float(np.median(ratios))
    summary["ratio_answer_spread"] = [min(ratios), max(ratios)]
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
