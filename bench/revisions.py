"""Per-frame time of two checkouts of this package, frame for frame interleaved.

    python -m bench.revisions OTHER_CHECKOUT [--size small] [--sessions 1] [--frames 150]

This machine's speed drifts by up to 2x between runs, so two separate runs of
a benchmark cannot tell a 3% change. Here each checkout runs in its own
process (its own ``.venv``, e.g. a ``git worktree`` of the base revision with
``make install``; it needs no copy of this script), both warmed past the encoder's windows, and the parent
asks them for one frame each in turn (the order alternating): both see the
same noise. It prints each side's median frame and the median of the
per-frame ratios (this checkout over the other). ``--sessions N`` steps a
:class:`~mlx_voicechat_plugin.runtime.pool.StreamPool` of N sessions.
A benchmark script, never a timed test.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARM_FRAMES = 75  # past the 70-frame encoder windows: the steady frame


def _child(size: str, sessions: int, checkpoint: str) -> None:
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.runtime.pool import StreamPool
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint, question_signal

    path = Path(checkpoint)
    if not path.exists():
        make_checkpoint(path, size)
    model, processor = load(path)
    voicechat = model.create_session(processor)
    frame = model.config.frame_samples
    audios = [question_signal(30.0, seed=i) for i in range(sessions)]
    if sessions == 1:
        stream = voicechat.create_streaming_session(seed=0)

        def run(k: int) -> None:
            stream.push_audio(audios[0][k * frame : (k + 1) * frame])
    else:
        pool = StreamPool(voicechat, max_sessions=sessions)
        for i in range(sessions):  # either revision's open signature
            if "factory" in inspect.signature(pool.open).parameters:
                pool.open(str(i), seed=i)
            else:
                from mlx_voicechat_plugin.runtime.options import ConversationOptions

                pool.open(str(i), ConversationOptions(seed=i))

        # A frame of PCM a session (this revision), or (PCM, rate) (older ones).
        paired = "tuple" in str(inspect.signature(pool.step).parameters["frames"].annotation)

        def run(k: int) -> None:
            pool.step({str(i): (a[k * frame : (k + 1) * frame], None) if paired
                       else a[k * frame : (k + 1) * frame] for i, a in enumerate(audios)})
    for k in range(WARM_FRAMES):
        run(k)
    print("ready", flush=True)
    for k, _ in enumerate(sys.stdin, start=WARM_FRAMES):
        started = time.perf_counter()
        run(k)
        print(time.perf_counter() - started, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.revisions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", help="the other checkout (with its own .venv)")
    parser.add_argument("--size", default="small", choices=("tiny", "small", "medium", "full"))
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--frames", type=int, default=150, help="timed frames (<= 300)")
    parser.add_argument("--checkpoint", default=None,
                        help="fixture directory both sides load (default: build/bench/<size>)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    checkpoint = str(Path(args.checkpoint or here / "build" / "bench" / args.size).resolve())
    if args.child:
        _child(args.size, args.sessions, checkpoint)
        return 0
    if not 1 <= args.frames <= 300:
        parser.error("--frames must be within 1..300")
    sides = {"this": here, "other": Path(args.other).resolve()}
    # This file runs as a script on both sides: the package each side imports is
    # the one its own .venv installs (the other checkout needs no copy of it).
    command = [str(Path(__file__).resolve()), "x", "--child", "--size", args.size,
               "--sessions", str(args.sessions), "--checkpoint", checkpoint]
    # The fixture is written once, by this side, before the other loads it.
    procs = {}
    for name, root in sides.items():
        procs[name] = subprocess.Popen([str(root / ".venv" / "bin" / "python"), *command],
                                       cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True)
        while (line := procs[name].stdout.readline()) and line.strip() != "ready":
            pass
        if not line:
            print(f"{name} ({root}) did not start", file=sys.stderr)
            return 1
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.frames):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            procs[name].stdin.write("go\n")
            procs[name].stdin.flush()
            times[name].append(float(procs[name].stdout.readline()))
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    for name, root in sides.items():
        print(f"{name:5s} {root}: median frame {1000 * statistics.median(times[name]):.2f} ms")
    ratios = [a / b for a, b in zip(times["this"], times["other"])]
    print(f"{args.size}, {args.sessions} session(s), {args.frames} frames: this/other "
          f"median per-frame ratio {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
