"""Kernel primitives and evaluations per pool step, per batch size: the GPU's cost, counted on a CPU.

    python -m bench.kernels --size medium --batch 1,16 [--compile/--no-compile]
        [--warm-frames 72] [--frames 6] [--per-row-attention] [--same-speech]
        [--json out.json]

For each N, N sessions (seeds 0..N-1, each its own speech signal) are opened
in one :class:`~mlx_voicechat_plugin.runtime.pool.StreamPool` and stepped
``--warm-frames`` frames untimed (the encoder's 70-frame windows fill; the
steady shapes are the ones a long conversation runs), then ``--frames`` steps
are timed (host CPU: the stepping thread's ``time.thread_time()`` around the
step, i.e. graph building, dispatch and books, since MLX computes on its own
threads; a GPU frame has this as a floor) and ``--frames`` more counted with
:class:`~mlx_voicechat_plugin.instruments.kernels.KernelCounter`:
the MLX primitives evaluated per step (views excluded, a compiled fused chain
counting once per call; at small batch a GPU launches about one kernel each)
and the evaluations (graph-evaluating calls: ``mx.eval``, ``async_eval``,
``item``, ``tolist``, numpy conversion) per step. Between the two, ``--frames``
steps are timed again with
:class:`~mlx_voicechat_plugin.instruments.kernels.EvaluationTime`, which splits
the host ms into the part inside those calls (MLX's graph walk, allocations,
dispatch and, on the CPU backend, its throttle's wake-ups: what grows with the
compute thread's work) and the part outside them (Python, graph building, the
books: what this package's bookkeeping decides). One more steady step per N runs
with ``mx.compile`` off under
:class:`~mlx_voicechat_plugin.instruments.matmuls.MatmulShapes`: the matrix
products it issues, how many of them are float products with more than one
row (``wide``: cuBLASLt on MLX's CUDA backend, not a gemv kernel node),
quantized ones with more than one row (``qmm``, not ``qmv``), and their
callers. Reported per N: median,
min and max over the counted steps, the graph nodes (views included: each
costs the host a dispatch), the matmuls among the primitives, the wide
float products of the uncompiled step (``wide``), the host
CPU ms per step with its ratio to the first N, and the stepping thread's
waits per step (how often it blocked: on MLX's CPU backend mostly the
evaluation's throttle, see ``instruments.kernels.thread_waits``). Counts do not
depend on the machine's load; host milliseconds do, so compare them as ratios
in one run.

Each N also reports in how many of its timed and counted steps the RNNT ran
its later tries (:class:`~mlx_voicechat_plugin.instruments.rnnt_tries.RNNTTries`):
a graph of ``max_symbols - 1`` masked tries of every row, queued when any
row's first try emitted, a few hundred kernels at any N. With each session
hearing its own speech, N=16's steps run it when any of sixteen rows emits and
N=1's only when its one row does, so their ratio mixes the batch's growth with
more transcript work; ``--same-speech`` gives every session session 0's
signal, so each row's work is N=1's and the ratios are the batch's own.

Each N past the first also times one graph of N=1's node count at N rows and
at one (:func:`backend_floor`: products at the LLM's width and elementwise
ops, as many evaluations as a step): the graph is the same, so its ratio is
what the backend itself charges the stepping thread for more rows, the floor
under the step's host ratio that no bookkeeping removes (on MLX's CPU backend
its throttle wakes this thread more often and allocates larger buffers; the
compute runs on MLX's own thread either way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from . import check_output

SIZES = ("tiny", "small", "medium", "full")


def count_steps(voicechat: Any, batch: int, warm_frames: int, frames: int,
                same_speech: bool = False) -> dict[str, Any]:
    """Counts per pool step of ``batch`` sessions, after ``warm_frames`` untimed steps
    (``same_speech``: every session hears session 0's signal, so each row's work is
    the one session's)."""
    from mlx_voicechat_plugin.runtime import compile_policy
    from mlx_voicechat_plugin.instruments.kernels import (VIEWS, EvaluationTime, KernelCounter,
                                                          host_ms, host_work)
    from mlx_voicechat_plugin.instruments.matmuls import MatmulShapes
    from mlx_voicechat_plugin.instruments.rnnt_tries import RNNTTries
    from mlx_voicechat_plugin.runtime.options import ConversationOptions
    from mlx_voicechat_plugin.runtime.pool import StreamPool
    from mlx_voicechat_plugin.testing.fixtures import question_signal

    frame = voicechat.config.frame_samples
    total = warm_frames + 3 * frames + 1  # the last step: products by shape
    seconds = (total + 1) * voicechat.config.frame_duration
    audios = [question_signal(seconds, seed=0 if same_speech else i) for i in range(batch)]
    pool = StreamPool(voicechat, max_sessions=batch)
    ids = [str(i) for i in range(batch)]
    for i in ids:
        pool.open(i, ConversationOptions(seed=int(i)))
    steps: list[dict[str, Any]] = []
    host: list[float] = []
    waits: list[int] = []
    split: list[tuple[float, float, int]] = []  # (host ms, of it in evaluations, waits there)
    outcome: list[Any] = []
    later_tries = 0  # timed and counted steps that ran the RNNT's later tries
    products: dict[str, Any] = {}
    try:
        for index in range(total):
            chunk = {k: audios[int(k)][index * frame : (index + 1) * frame] for k in ids}
            tries = RNNTTries()
            if index < warm_frames:
                result = pool.step(chunk)
            elif index < warm_frames + frames:  # timed, never counted (the count costs host time)
                with tries:
                    ms, blocked = host_work(lambda: outcome.append(pool.step(chunk)))
                host.append(ms)
                if blocked is not None:
                    waits.append(blocked)
                result = outcome.pop()
            elif index < warm_frames + 2 * frames:  # timed again, split at the evaluations
                with EvaluationTime() as clock, tries:
                    ms = host_ms(lambda: outcome.append(pool.step(chunk)))
                split.append((ms, clock.ms, clock.waits))
                result = outcome.pop()
            elif index < warm_frames + 3 * frames:
                with KernelCounter() as counter, tries:
                    result = pool.step(chunk)
                steps.append(counter.snapshot())
                steps[-1]["primitives"] = {k: v for k, v in counter.primitives.items()
                                           if k not in VIEWS}
            else:  # compiled spans replay without Python: their products show uncompiled
                with compile_policy.suspended(), MatmulShapes() as shapes:
                    result = pool.step(chunk)
                products = shapes.summary()
            later_tries += tries.later > 0
            if result.errors:
                raise RuntimeError(f"step {index}: {result.errors}")
    finally:
        pool.close_all()

    def summary(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    def counts(key: str) -> dict[str, float]:
        return summary([s[key] for s in steps])

    return {"batch": batch, "steps": len(steps), "kernels": counts("kernels"),
            "evaluation_ms": summary([e for _, e, _ in split]),
            "outside_ms": summary([h - e for h, e, _ in split]),
            "evaluation_waits": summary([w for _, _, w in split]),
            "nodes": counts("nodes"), "evaluations": counts("evaluations"),
            "matmuls": counts("matmuls"),
            "later_tries": later_tries,
            "host_ms": summary(host), "waits": summary(waits) if waits else None,
            "products": products.get("products", 0), "wide_float": products.get("wide_float", 0),
            "wide_quantized": products.get("wide_quantized", 0),
            "wide_callers": products.get("wide_callers", {}), "product_shapes": products,
            "calls": steps[-1]["calls"] if steps else [],
            "primitives_last_step": steps[-1]["primitives"] if steps else {}}


def backend_floor(width: int, batch: int, nodes: int, evaluations: int = 4,
                  reps: int = 7) -> dict[str, float]:
    """The stepping thread's host ms for one graph of ``nodes`` nodes at 1 row and at
    ``batch`` rows, medians of ``reps`` runs taken in turn: blocks of a ``[B, width]``
    by ``[width, width]`` product and four elementwise ops, evaluated in ``evaluations``
    calls. The graph is the same at both sizes, so its ratio is what the backend
    itself charges this thread for more rows (on MLX's CPU backend: its throttle's
    wake-ups and larger buffers), the floor under a pool step's host ratio."""
    import mlx.core as mx

    from mlx_voicechat_plugin.instruments.kernels import host_ms

    weights = [mx.random.normal((width, width)) * width**-0.5 for _ in range(8)]
    bias = mx.zeros((width,))
    mx.eval(weights, bias)
    blocks = max(1, nodes // 5)
    per_eval = max(1, blocks // evaluations)

    def run(rows: int) -> float:
        x = mx.random.normal((rows, width))
        mx.eval(x)

        def graph() -> None:
            y = x
            for i in range(blocks):
                y = mx.tanh(y @ weights[i % 8] + bias) * 0.5 + y
                if (i + 1) % per_eval == 0 or i == blocks - 1:
                    mx.eval(y)

        return host_ms(graph)

    times: dict[int, list[float]] = {1: [], batch: []}
    for _ in range(reps):
        for rows in times:
            times[rows].append(run(rows))
    one, many = statistics.median(times[1]), statistics.median(times[batch])
    return {"one_ms": one, "batch_ms": many, "ratio": many / one}


def load_fixture(size: str, seed: int = 0, tmp: str | None = None) -> tuple[Any, Any]:
    """The plugin's model and tokenizer of fixture ``size`` (``full``: built on the device)."""
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint

    root = Path(tmp or tempfile.mkdtemp(prefix="voicechat-bench-"))
    return load(make_checkpoint(root / f"{size}-s{seed}", size, seed=seed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="medium", choices=SIZES)
    parser.add_argument("--batch", default="1,16", help="batch sizes N, comma-separated")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="mx.compile on (as a GPU runs it) or off")
    parser.add_argument("--warm-frames", type=int, default=72,
                        help="untimed steps first (the encoder's windows fill in 70)")
    parser.add_argument("--frames", type=int, default=6, help="counted steps per N")
    parser.add_argument("--per-row-attention", action="store_true",
                        help="each session's attention core on its own ring (the exact path "
                             "kept for GPUs; default: one core for all sessions)")
    parser.add_argument("--same-speech", action="store_true",
                        help="every session hears session 0's signal: each row's work (the "
                             "RNNT's tries above all) is N=1's, so the ratios show the batch's "
                             "own growth")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    check_output(parser, args.json, "--json")
    batches = [int(b) for b in args.batch.split(",") if b.strip()]

    import mlx.core as mx

    from mlx_voicechat_plugin.runtime import compile_policy

    compile_policy.apply(args.compile, long_running=True)
    with tempfile.TemporaryDirectory() as tmp:
        model, processor = load_fixture(args.size, tmp=tmp)
    if args.per_row_attention:
        model.set_batched_cores(False)
    voicechat = model.create_session(processor)
    rows = []
    print(f"{args.size} fixture, compile {'on' if args.compile else 'off'}, "
          f"{mx.default_device()}, counted after {args.warm_frames} frames"
          f"{', every session hearing the same speech' if args.same_speech else ''}", flush=True)
    print(f"{'N':>3s} {'kernels/step':>13s} {'(min-max)':>13s} {'x N=1':>6s} "
          f"{'nodes':>6s} {'matmuls':>8s} {'wide':>5s} {'evals/step':>10s} {'host ms':>8s} "
          f"{'x N=1':>6s} {'waits':>6s}",
          flush=True)
    for n in batches:
        row = count_steps(voicechat, n, args.warm_frames, args.frames, args.same_speech)
        rows.append(row)
        base, host_base = rows[0]["kernels"]["median"], rows[0]["host_ms"]["median"]
        k, host = row["kernels"], row["host_ms"]["median"]
        print(f"{n:3d} {k['median']:13.0f} {k['min']:6.0f}-{k['max']:<6.0f} "
              f"{k['median'] / base:6.2f} {row['nodes']['median']:6.0f} "
              f"{row['matmuls']['median']:8.0f} {row['wide_float']:5d} "
              f"{row['evaluations']['median']:10.0f} "
              f"{host:8.1f} {host / host_base:6.2f} "
              f"{row['waits']['median'] if row['waits'] else float('nan'):6.0f}", flush=True)
        outside, outside_base = row["outside_ms"]["median"], rows[0]["outside_ms"]["median"]
        print(f"    host ms split: {row['evaluation_ms']['median']:.1f} in evaluations "
              f"({row['evaluation_waits']['median']:.0f} waits), {outside:.1f} outside "
              f"(x N=1 {outside / outside_base:.2f}); the RNNT's later tries ran in "
              f"{row['later_tries']} of {3 * args.frames} steps", flush=True)
        if n != rows[0]["batch"]:
            row["floor"] = backend_floor(voicechat.config.text_config.hidden_size, n,
                                         int(rows[0]["nodes"]["median"]))
            floor = row["floor"]
            print(f"    the same graph at {n} rows and at 1 (the backend's own growth, "
                  f"{rows[0]['nodes']['median']:.0f} nodes): {floor['batch_ms']:.1f} against "
                  f"{floor['one_ms']:.1f} host ms (x {floor['ratio']:.2f}); the step's "
                  f"x {host / host_base:.2f} is {host / host_base / floor['ratio']:.2f} of it",
                  flush=True)
        callers = ", ".join(f"{caller} {count}"
                            for caller, count in list(row["wide_callers"].items())[:3])
        print(f"    wide float products by caller: {callers or 'none'}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"size": args.size, "compile": args.compile, "same_speech": args.same_speech, "device": str(mx.default_device()),
             "warm_frames": args.warm_frames, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
