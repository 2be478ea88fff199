"""Aggregate frames/s of N sessions on one model: stepped together vs one after another.

    python -m bench.sessions [--size small] [--sessions 1 2 4 8] [--seconds 2]
                             [--json out.json] [--png out.png]

For each N, N sessions (different seeds) each take ``--seconds`` of speech,
timed after ``--skip-seconds`` (the steady frames of a long conversation):
"together" opens them in one :class:`~mlx_voicechat_plugin.runtime.pool.StreamPool`
and steps all of them one frame per step; "one after another" runs the same N
sessions alone in turn. Both are timed in this process, after a warm-up
session, and reported as aggregate frames per second and as the ratio to one
session (and, for "together", a short warm-up at each N: compiled runs trace
once per batch size). Every session's codes are checked equal between the
two runs.
A benchmark script, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from . import check_output


def _together(voicechat, audios: list[np.ndarray], frame: int, skip: int = 0
              ) -> tuple[float, int, list]:
    from mlx_voicechat_plugin.runtime.events import Audio
    from mlx_voicechat_plugin.runtime.options import ConversationOptions
    from mlx_voicechat_plugin.runtime.pool import StreamPool

    pool = StreamPool(voicechat, max_sessions=len(audios))
    codes: list[list] = [[] for _ in audios]
    for i in range(len(audios)):
        pool.open(str(i), ConversationOptions(seed=i))
    seconds, timed = 0.0, 0
    for index, start in enumerate(range(0, len(audios[0]) - frame + 1, frame)):
        started = time.perf_counter()
        result = pool.step({str(i): a[start : start + frame] for i, a in enumerate(audios)})
        if index >= skip:
            seconds += time.perf_counter() - started
            timed += result.frames
        for key, events in result.events.items():
            codes[int(key)] += [e.audio_codes.tolist() for e in events if isinstance(e, Audio)]
    pool.close_all()
    return seconds, timed, codes


def _one_after_another(voicechat, audios: list[np.ndarray], frame: int, skip: int = 0
                       ) -> tuple[float, int, list]:
    from mlx_voicechat_plugin.runtime.events import Audio

    codes: list[list] = []
    seconds, timed = 0.0, 0
    for i, audio in enumerate(audios):
        stream = voicechat.create_streaming_session(seed=i)
        events = []
        for index, start in enumerate(range(0, len(audio), frame)):
            started = time.perf_counter()
            events += stream.push_audio(audio[start : start + frame])
            if index >= skip:
                seconds += time.perf_counter() - started
                timed += 1
        stream.cancel()
        codes.append([e.audio_codes.tolist() for e in events if isinstance(e, Audio)])
    return seconds, timed, codes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sessions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=("tiny", "small", "medium", "full"))
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--skip-seconds", type=float, default=6.0,
                        help="untimed start of every session (the encoder's 70-frame windows "
                             "fill in 5.6 s; after that a frame has its steady cost)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    args = parser.parse_args(argv)
    check_output(parser, args.json, "--json")

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint, question_signal

    with tempfile.TemporaryDirectory() as tmp:
        model, processor = load(make_checkpoint(Path(tmp) / args.size, args.size))
    voicechat = model.create_session(processor)
    frame = model.config.frame_samples
    _one_after_another(voicechat, [question_signal(1.0)], frame)  # warm-up: compiles
    rows = []
    skip = int(args.skip_seconds / model.config.frame_duration)
    for n in args.sessions:
        audios = [question_signal(args.seconds, seed=i) for i in range(n)]
        _together(voicechat, [a[: 4 * frame] for a in audios], frame)  # compiles batch-N kernels
        together, serial, exact = [], [], True
        for r in range(args.rounds):  # interleaved, the order alternating: this machine is noisy
            runs = [("together", _together), ("serial", _one_after_another)]
            for name, run in runs if r % 2 == 0 else runs[::-1]:
                seconds, frames, codes = run(voicechat, audios, frame, skip)
                (together if name == "together" else serial).append(frames / seconds)
                if name == "together":
                    codes_together = codes
                else:
                    codes_serial = codes
            exact = exact and codes_together == codes_serial
        rows.append({"sessions": n, "frames": frames,
                     "together_fps": statistics.median(together),
                     "serial_fps": statistics.median(serial),
                     "together_fps_rounds": together, "serial_fps_rounds": serial,
                     "exact": exact})
    # One session alone: the median of both modes' N=1 rounds (the same work).
    base = statistics.median(rows[0]["together_fps_rounds"] + rows[0]["serial_fps_rounds"]) \
        if rows and rows[0]["sessions"] == 1 else None
    print(f"{args.size} fixture, {args.seconds:g} s a session, timed after {args.skip_seconds:g} s")
    print(f"{'N':>3s} {'together f/s':>13s} {'serial f/s':>11s} {'x one':>6s} {'exact':>6s}")
    for row in rows:
        ratio = row["together_fps"] / base if base else float("nan")
        row["together_vs_one_session"] = ratio
        print(f"{row['sessions']:3d} {row['together_fps']:13.1f} {row['serial_fps']:11.1f} "
              f"{ratio:6.2f} {str(row['exact']):>6s}")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "rows": rows}, indent=2))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n = [r["sessions"] for r in rows]
        plt.plot(n, [r["together_fps"] for r in rows], "o-", label="stepped together")
        plt.plot(n, [r["serial_fps"] for r in rows], "s--", label="one after another")
        plt.xlabel("sessions")
        plt.ylabel("aggregate frames / s")
        plt.title(f"{args.size} fixture")
        plt.legend()
        plt.savefig(args.png, dpi=120)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
