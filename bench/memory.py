"""Memory and load-to-ready of the plugin and the mlx-vlm reference, each side in its own process.

    python -m bench.memory CHECKPOINT [CHECKPOINT ...] [--sides plugin,reference]
        [--memory-budget GIB] [--seconds 10] [--offline-seconds 4] [--out bench/results]

Per checkpoint (any profile: the reference is tried on each and its error is
recorded where it cannot load one) and per side, a fresh Python process
(``--worker``) measures, with MLX's allocator (``mx.get_active_memory`` /
``mx.get_peak_memory``: on a CPU the same bytes Metal would hold):

- ``weights_gib``: active memory after load (and, for the plugin, its
  ``prepare`` and warm start), i.e. what stays resident for the model;
- ``load_peak_gib``: the peak while loading;
- ``stream_peak_gib``: the peak of one streaming session of ``--seconds`` of
  speech-like input (questions and pauses), pushed one 80 ms frame at a time;
- ``offline_peak_gib``: the peak of one offline turn of ``--offline-seconds``
  (the reference with its language cache, its fast path);
- ``state_bytes``: active memory a live session holds above the weights after
  the stream (both sides), and the plugin's own count (``stream.nbytes``: the
  positions written) beside the bytes of its KV rings allocated whole at the
  first frame (``kv_rings_allocated_bytes``, from the config);
- ``first_frame_peak_above_weights_gib`` / ``after_first_frame_above_weights_gib``:
  the peak during the session's start and first frame, and what stays after it;
- ``load_s``, ``session_s`` (``create_session``: the warm start), ``first_frame_s``
  (``create_streaming_session`` and the first frame) and ``ready_s``, their sum;
- ``frame_s``: seconds per frame of the stream after its first (mean, median, p95);
- ``max_rss_gib``: the process's resident high-water mark (the OS's view).

One JSON per checkpoint, ``<out>/memory-<checkpoint name>[-budget<GIB>].json``,
holds both sides and the ratios. These are benchmark figures, never test
assertions. Full-size runs take minutes and about 12 GiB per side; the sides
run one after the other.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from . import check_output

GIB = 2**30


def _gib(nbytes: float) -> float:
    return round(nbytes / GIB, 4)


def _reset() -> None:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


def _load(side: str, checkpoint: str, budget: float | None) -> tuple[Any, Any]:
    if side == "plugin":
        from mlx_voicechat_plugin import load

        kwargs = {} if budget is None else {"memory_budget": budget}
        return load(checkpoint, **kwargs)
    from mlx_vlm.utils import load as reference_load

    return reference_load(checkpoint)


def measure(side: str, checkpoint: str, seconds: float, offline_seconds: float,
            budget: float | None) -> dict[str, Any]:
    """Every figure of one side, in this process (``offline_seconds`` 0: no offline turn)."""
    import mlx.core as mx

    from mlx_voicechat_plugin.config import ModelConfig
    from mlx_voicechat_plugin.checkpoint import read_config
    from mlx_voicechat_plugin.testing.fixtures import conversation_signal, question_signal

    wrap = (lambda x: x) if side == "plugin" else mx.array
    out: dict[str, Any] = {"side": side, "device": str(mx.default_device())}
    _reset()
    began = time.perf_counter()
    model, processor = _load(side, checkpoint, budget)
    mx.eval(model.parameters())
    out["load_s"] = time.perf_counter() - began
    began = time.perf_counter()
    session = model.create_session(processor)
    out["session_s"] = time.perf_counter() - began
    mx.synchronize()
    gc.collect()
    mx.clear_cache()
    out["weights_gib"] = _gib(mx.get_active_memory())
    out["load_peak_gib"] = _gib(mx.get_peak_memory())
    if side == "plugin":
        out["f32_hold"] = model.memory_plan.hold_f32
    config = ModelConfig.from_dict(read_config(Path(checkpoint)))  # the reference's lacks these
    rate, frame = config.input_sample_rate, config.frame_samples
    audio = conversation_signal(seconds, rate)

    mx.reset_peak_memory()
    weights = mx.get_active_memory()
    began = time.perf_counter()
    stream = session.create_streaming_session()
    stream.push_audio(wrap(audio[:frame]))
    mx.synchronize()
    out["first_frame_s"] = time.perf_counter() - began
    out["ready_s"] = out["load_s"] + out["session_s"] + out["first_frame_s"]
    out["first_frame_peak_above_weights_gib"] = _gib(mx.get_peak_memory() - weights)
    first_active = mx.get_active_memory()
    out["after_first_frame_above_weights_gib"] = _gib(first_active - weights)
    times = []
    for start in range(frame, len(audio) - frame + 1, frame):
        chunk = wrap(audio[start:start + frame])
        began = time.perf_counter()
        stream.push_audio(chunk)
        times.append(time.perf_counter() - began)
    mx.synchronize()
    out["frames"] = len(times) + 1
    out["stream_peak_gib"] = _gib(mx.get_peak_memory())
    out["stream_peak_above_weights_gib"] = _gib(mx.get_peak_memory() - weights)
    gc.collect()
    mx.clear_cache()
    out["state_bytes"] = int(mx.get_active_memory() - weights)
    if side == "plugin":
        from mlx_voicechat_plugin.budget import session_bytes

        out["state_nbytes_counted"] = int(stream.nbytes)  # the positions written so far
        out["kv_rings_allocated_bytes"] = session_bytes(config)  # the rings, whole
    out["frame_s"] = {"mean": float(np.mean(times)), "median": float(np.median(times)),
                      "p95": float(np.percentile(times, 95))}
    stream.flush()
    del stream
    _reset()

    out["max_rss_gib"] = _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if offline_seconds <= 0:
        return out
    question = question_signal(offline_seconds, sample_rate=rate)
    began = time.perf_counter()
    if side == "plugin":
        session.generate(question, extra_decoding_seconds=0.0)
    else:
        session.generate(mx.array(question), use_language_cache=True)
    mx.synchronize()
    out["offline_s"] = time.perf_counter() - began
    out["offline_peak_gib"] = _gib(mx.get_peak_memory())
    out["max_rss_gib"] = _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


def _run_side(side: str, checkpoint: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One side in a fresh interpreter; its JSON is the last line it prints."""
    command = [sys.executable, "-m", "bench.memory", "--worker", side, str(checkpoint),
               "--seconds", str(args.seconds), "--offline-seconds", str(args.offline_seconds)]
    if args.memory_budget is not None and side == "plugin":
        command += ["--memory-budget", str(args.memory_budget)]
    print(f"[{side}] {checkpoint.name}", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"side": side, "error": f"exit {done.returncode}"}
    return json.loads(lines[-1])


def _ratios(plugin: dict, reference: dict) -> dict[str, float]:
    keys = ("weights_gib", "stream_peak_gib", "offline_peak_gib", "ready_s")
    ratios = {k: plugin[k] / reference[k] for k in keys if k in plugin and k in reference}
    if "frame_s" in plugin and "frame_s" in reference:
        ratios["frame_s_median"] = plugin["frame_s"]["median"] / reference["frame_s"]["median"]
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory")
    parser.add_argument("checkpoints", nargs="+", help="checkpoint directories (any profile)")
    parser.add_argument("--sides", default="plugin,reference")
    parser.add_argument("--memory-budget", type=float, default=None,
                        help="the plugin's load(memory_budget=GIB); default: the device's")
    parser.add_argument("--seconds", type=float, default=10.0, help="streaming session length")
    parser.add_argument("--offline-seconds", type=float, default=4.0,
                        help="offline turn length (0: none)")
    parser.add_argument("--tag", default="", help="appended to the result's file name")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--worker", choices=("plugin", "reference"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_output(parser, Path(args.out) / "memory.json", "--out")
    if args.worker:
        figures = measure(args.worker, args.checkpoints[0], args.seconds,
                          args.offline_seconds, args.memory_budget)
        print(json.dumps(figures), flush=True)
        return 0

    import mlx.core as mx

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    for checkpoint in map(Path, args.checkpoints):
        report: dict[str, Any] = {
            "checkpoint": checkpoint.name, "memory_budget_gib": args.memory_budget,
            "seconds": args.seconds, "offline_seconds": args.offline_seconds,
            "machine": f"{platform.system()} {platform.machine()}, {mx.default_device()}",
            "mlx": mx.__version__,
            "note": "MLX allocator bytes; each side in its own process, one after the other",
        }
        for side in sides:
            report[side] = _run_side(side, checkpoint, args)
            print(json.dumps({side: report[side]}), file=sys.stderr, flush=True)
        if "plugin" in report and "reference" in report:
            report["ratio_plugin_over_reference"] = _ratios(report["plugin"], report["reference"])
        suffix = "" if args.memory_budget is None else f"-budget{args.memory_budget:g}"
        suffix += f"-{args.tag}" if args.tag else ""
        path = out / f"memory-{checkpoint.name}{suffix}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
