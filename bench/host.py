"""Host work per frame, side by side with the reference in one process: the CPU proxies of a GPU frame.

    python -m bench.host --size medium [--seed 0] [--warm-frames 76] [--frames 12]
        [--rounds 2] [--json out.json]

On a GPU, where kernels are cheap, the thread that builds and dispatches a
frame's graph is a floor under the frame. Here one streaming session of the
plugin and one of the reference (same checkpoint, same input) are stepped
frame by frame, interleaved (one frame of each, the order alternating each
round), past ``--warm-frames`` (the encoder's 70-frame windows fill); then
for ``--frames`` steady frames of each side:

- host CPU ms per frame: the stepping thread's ``time.thread_time()`` around
  ``push_audio`` (MLX computes on its own threads, so this is Python, graph
  building, compile-cache lookups, dispatch and books), the median over the
  frames of each round and its ratio plugin / reference per round;
- waits per frame: how often the stepping thread blocked in those frames
  (its voluntary context switches, the median over every timed frame; on
  MLX's CPU backend mostly the evaluation's throttle, a cost of this proxy
  that a GPU backend pays about ten times less often; ``None`` where the
  system does not count them per thread);
- in a separate counted pass (the counter's export costs host time, so it
  is never timed): kernels, graph nodes (views included) and evaluations per
  frame (:class:`~mlx_voicechat_plugin.instruments.kernels.KernelCounter`).

Absolute CPU milliseconds move with the machine's load; the ratios, taken in
one run with the frames interleaved, are the figure. Counts never move.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .kernels import SIZES
from . import check_output


def counted(run: Callable[[], Any]) -> dict[str, int]:
    """Kernels, graph nodes (views included) and evaluations of ``run()``."""
    from mlx_voicechat_plugin.instruments.kernels import KernelCounter

    with KernelCounter() as counter:
        run()
    return {"kernels": counter.kernels, "nodes": counter.nodes, "views": counter.views,
            "evaluations": counter.evaluations}


class Side:
    """One streaming session of one implementation, pushed one frame at a time."""

    def __init__(self, name: str, session: Any, wrap: Callable[[np.ndarray], Any],
                 audio: np.ndarray, frame: int):
        self.name, self.wrap, self.audio, self.frame = name, wrap, audio, frame
        self.stream = session.create_streaming_session()
        self.index = 0

    def push(self) -> None:
        start = self.index * self.frame
        self.stream.push_audio(self.wrap(self.audio[start : start + self.frame]))
        self.index += 1


def side_by_side(ours: Any, theirs: Any, audio: np.ndarray, frame: int, warm: int,
                 frames: int, rounds: int) -> dict[str, Any]:
    """Host CPU per frame of both sides, interleaved, then their counts per frame."""
    import mlx.core as mx

    from mlx_voicechat_plugin.instruments.kernels import host_work

    sides = [Side("plugin", ours, lambda x: x, audio, frame),
             Side("reference", theirs, mx.array, audio, frame)]
    for _ in range(warm):
        for side in sides:
            side.push()
    times: dict[str, list[list[float]]] = {s.name: [] for s in sides}
    waits: dict[str, list[int]] = {s.name: [] for s in sides}
    for r in range(rounds):
        round_times: dict[str, list[float]] = {s.name: [] for s in sides}
        for _ in range(frames):
            for side in sides if r % 2 == 0 else sides[::-1]:
                ms, blocked = host_work(side.push)
                round_times[side.name].append(ms)
                if blocked is not None:
                    waits[side.name].append(blocked)
        for name, values in round_times.items():
            times[name].append(values)
    counts = {s.name: [counted(s.push) for _ in range(3)] for s in sides}
    medians = {name: [statistics.median(v) for v in runs] for name, runs in times.items()}
    ratios = [a / b for a, b in zip(medians["plugin"], medians["reference"])]
    report: dict[str, Any] = {
        "host_ms_round_medians": medians,
        "host_ratio_rounds": ratios, "host_ratio": statistics.median(ratios),
        "waits": {name: statistics.median(w) if w else None for name, w in waits.items()},
    }
    for key in ("kernels", "nodes", "views", "evaluations"):
        values = {name: statistics.median(c[key] for c in cs) for name, cs in counts.items()}
        report[key] = values
        report[f"{key}_ratio"] = values["plugin"] / max(values["reference"], 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium", choices=SIZES)
    parser.add_argument("--seed", type=int, default=0, help="the fixture's seed")
    parser.add_argument("--warm-frames", type=int, default=76)
    parser.add_argument("--frames", type=int, default=12, help="timed frames a side a round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    check_output(parser, args.json, "--json")

    import mlx.core as mx
    from mlx_vlm.utils import load as reference_load

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import conversation_signal, make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_checkpoint(Path(tmp) / f"{args.size}-s{args.seed}", args.size,
                                     seed=args.seed)
        model, processor = load(checkpoint)
        ref, ref_processor = reference_load(str(checkpoint))
    ours, theirs = model.create_session(processor), ref.create_session(ref_processor)
    frame = model.config.frame_samples
    total = args.warm_frames + args.rounds * args.frames + 4
    audio = conversation_signal(total * model.config.frame_duration,
                                model.config.input_sample_rate)
    report = side_by_side(ours, theirs, audio, frame, args.warm_frames, args.frames,
                          args.rounds)
    report |= {"size": args.size, "seed": args.seed, "device": str(mx.default_device()),
               "warm_frames": args.warm_frames, "frames": args.frames, "rounds": args.rounds}
    print(json.dumps(report, indent=1), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
