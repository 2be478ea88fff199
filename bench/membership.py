"""What a change of a pool's membership costs the step, above a steady step.

    python -m bench.membership [--size small] [--sessions 8] [--cycles 12] [--checkout DIR]

A :class:`~mlx_voicechat_plugin.runtime.pool.StreamPool` of ``--sessions``
conversations is warmed past the encoder's windows, then one session pauses
for 3 frames every 10 (its frame left out of the step, as the server leaves a
quiet client's row out): the step it leaves at and the step it comes back at
change the batch's members. Each step's host CPU (``time.thread_time``, the
engine thread's own work, evaluations included) is recorded; it prints the
median steady step and the median cost of a leaving and of a returning step
above it. Then, ``--cycles`` times, a fresh conversation (no prompt: at its
first position it neither talks nor has its language state yet) opens and
joins the others' step, steps once more with them (it stacks with them
there) and closes: the median cost of its joining step and of the step after
above the steady one. ``--checkout DIR`` runs another checkout of the package (e.g. a
``git worktree`` of the base revision) in a child process with the same
arguments, and the two are printed side by side. A benchmark script, never a
timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WARM_FRAMES = 75  # past the 70-frame encoder windows
FRAME = 1280  # 80 ms at 16 kHz


def measure(size: str, sessions: int, cycles: int) -> dict[str, float]:
    """Median host ms of a steady step, and above it of a leave, a return, a fresh
    conversation's joining step and the step after it."""
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.runtime.pool import StreamPool
    from mlx_voicechat_plugin.testing.fixtures import cached_checkpoint, conversation_signal

    model, processor = load(cached_checkpoint(size))
    pool = StreamPool(model.create_session(processor), max_sessions=sessions + 1)
    ids = [f"s{i}" for i in range(sessions)]
    for sid in ids:
        pool.open(sid)
    total = WARM_FRAMES + cycles * 10
    audio = conversation_signal((total + cycles * 4) * FRAME / 16_000)
    steady, leave, back = [], [], []
    for index in range(total):
        frame = audio[index * FRAME:(index + 1) * FRAME]
        phase = (index - WARM_FRAMES) % 10
        paused = index >= WARM_FRAMES and phase in (5, 6, 7)
        frames = {sid: frame for sid in ids if not (paused and sid == ids[0])}
        started = time.thread_time()
        pool.step(frames)
        spent = (time.thread_time() - started) * 1000
        if index < WARM_FRAMES:
            continue
        {5: leave, 8: back}.get(phase, steady if phase in (1, 2, 3) else []).append(spent)
    join, settle = [], []
    for cycle in range(cycles):  # a fresh conversation joins, steps once more, closes
        pool.open("fresh")
        for step, record in enumerate((join, settle, None, None)):
            index = total + cycle * 4 + step
            frame = audio[index * FRAME:(index + 1) * FRAME]
            frames = {sid: frame for sid in ids + (["fresh"] if "fresh" in pool else [])}
            started = time.thread_time()
            pool.step(frames)
            if record is not None:
                record.append((time.thread_time() - started) * 1000)
            if step == 1:
                pool.close("fresh")
    pool.close_all()
    base = statistics.median(steady)
    return {"steady_ms": base, "leave_ms": statistics.median(leave) - base,
            "return_ms": statistics.median(back) - base,
            "join_ms": statistics.median(join) - base,
            "after_join_ms": statistics.median(settle) - base}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="fixture size (default: small)")
    parser.add_argument("--sessions", type=int, default=8, help="pool size (default: 8)")
    parser.add_argument("--cycles", type=int, default=12,
                        help="pause cycles of 10 frames measured (default: 12)")
    parser.add_argument("--checkout", default=None,
                        help="another checkout to run the same way, in a child process")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(measure(args.size, args.sessions, args.cycles)))
        return
    runs = {"this checkout": None} | ({args.checkout: args.checkout} if args.checkout else {})
    for label, root in runs.items():
        command = [sys.executable, os.path.abspath(__file__), "--json", "--size", args.size,
                   "--sessions", str(args.sessions), "--cycles", str(args.cycles)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.abspath(root if root is not None else os.getcwd())
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{label}: steady step {figures['steady_ms']:.2f} ms; above it, a row leaving "
              f"{figures['leave_ms']:.2f} ms, a row returning {figures['return_ms']:.2f} ms, "
              f"a fresh conversation joining {figures['join_ms']:.2f} ms and the step after "
              f"{figures['after_join_ms']:.2f} ms")


if __name__ == "__main__":
    main()
