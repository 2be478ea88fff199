"""Side-by-side timing of the plugin and the upstream reference, in one process.

    python -m bench.compare --size small [--seeds 0,1] [--frames N] [--rounds 5]
        [--seconds 10] [--no-offline] [--scaling 5,20,60] [--out build/bench]

On each fixture checkpoint (one per ``--seeds`` entry, all of ``--size``) and
one input it times:
- offline: the reference's default path (full recompute), the reference with
  its language cache, and the plugin;
- streaming: per-frame mean / p50 / p95 of plain (unprofiled) ``push_audio``
  wall-clock, both sides warmed first, then timed in ``--rounds`` interleaved
  rounds (the order alternates each round); the headline is the median of the
  per-round ratios with their spread (min, max); per stage from a profiled
  run, with the counted host syncs and the time spent inside them and inside
  ``mx.async_eval``;
- peak memory of each run;
- a scaling run: streaming per-frame cost against session length;
- per stage, a matmul floor next to the measured time (``bench/floors.py``:
  the stage's multiply-accumulates per frame at this machine's measured
  float32 matmul throughput);
- the session start (``create_streaming_session``) of both sides.
Figures are ratios plugin / reference; ``across_seeds`` puts every fixture's
streaming headline side by side with the worst of them, so a figure cannot
come from one lucky fixture. Results go to ``<out>/compare.json``
and, with matplotlib installed (``pip install .[bench]``), ``<out>/compare.png``.
These are benchmark figures, never test assertions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from . import check_output


def _timed(run: Callable[[], Any]) -> tuple[float, float]:
    mx.clear_cache()
    mx.reset_peak_memory()
    began = time.perf_counter()
    run()
    return time.perf_counter() - began, mx.get_peak_memory() / 2**20


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean_ms": float(np.mean(values)), "p50_ms": float(np.percentile(values, 50)),
            "p95_ms": float(np.percentile(values, 95))}


def _push_times(stream: Any, audio: np.ndarray, frame: int, wrap: Callable) -> list[float]:
    """Wall-clock milliseconds of each one-frame ``push_audio``."""
    times = []
    for start in range(0, len(audio) - frame + 1, frame):
        chunk = wrap(audio[start : start + frame])
        began = time.perf_counter()
        stream.push_audio(chunk)
        times.append((time.perf_counter() - began) * 1e3)
    return times


STAGES = ("perception", "rnnt", "language", "tts", "codec")


def _stream_ours(
    session: Any, audio: np.ndarray, frame: int, stages: bool = True
) -> tuple[dict, list[float]]:
    """Plain wall-clock per frame, then (``stages``) a profiled run for the stage split."""
    stream = session.create_streaming_session()
    totals = _push_times(stream, audio, frame, lambda x: x)
    stream.flush()
    if not stages:
        return {"total": _stats(totals)}, totals
    profiled = session.create_streaming_session(profile=True)
    _push_times(profiled, audio, frame, lambda x: x)
    frames = profiled.profile().frames
    profiled.flush()
    stages = {s: _stats([f.stages_ms.get(s, 0.0) for f in frames]) for s in STAGES}
    return {"total": _stats(totals), "profiled_total": _stats([f.total_ms for f in frames]),
            "stages": stages, "host_syncs": float(np.mean([f.host_syncs for f in frames])),
            "wait_ms": float(np.mean([f.wait_ms for f in frames])),
            "async_eval_ms": float(np.mean([f.async_eval_ms for f in frames]))}, totals


def _stream_reference(
    session: Any, audio: np.ndarray, frame: int, stages: bool = True
) -> tuple[dict, list[float]]:
    stream = session.create_streaming_session()
    totals = _push_times(stream, audio, frame, mx.array)
    stream.flush()
    if not stages:
        return {"total": _stats(totals)}, totals
    profiled = session.create_streaming_session(profile=True)
    _push_times(profiled, audio, frame, mx.array)
    frames = profiled.profile.frames
    profiled.flush()
    stages = {s: _stats([getattr(f, f"{s}_ms") for f in frames]) for s in STAGES}
    return {"total": _stats(totals), "profiled_total": _stats([f.total_ms for f in frames]),
            "stages": stages}, totals


def _interleaved(ours: Any, theirs: Any, audio: np.ndarray, frame: int, rounds: int) -> dict:
    """Warm both sides, then ``rounds`` plain streaming runs each, alternating who goes first."""
    warm = audio[: 10 * frame]
    _stream_ours(ours, warm, frame, stages=False)
    _stream_reference(theirs, warm, frame, stages=False)
    runs: dict[str, list[list[float]]] = {"plugin": [], "reference": []}
    sides = [("plugin", lambda: _stream_ours(ours, audio, frame, stages=False)[1]),
             ("reference", lambda: _stream_reference(theirs, audio, frame, stages=False)[1])]
    for r in range(rounds):
        for name, run in sides if r % 2 == 0 else sides[::-1]:
            runs[name].append(run())
    means = {name: [float(np.mean(t)) for t in times] for name, times in runs.items()}
    ratios = [a / b for a, b in zip(means["plugin"], means["reference"])]
    return {
        "rounds": rounds,
        "plugin_round_means_ms": means["plugin"], "reference_round_means_ms": means["reference"],
        "ratio_median": float(np.median(ratios)), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "plugin_all": _stats([t for run in runs["plugin"] for t in run]),
        "reference_all": _stats([t for run in runs["reference"] for t in run]),
    }, runs["plugin"][-1], runs["reference"][-1]


def _fixture_report(args: argparse.Namespace, seed: int) -> tuple[dict, dict]:
    """Every section for the fixture of ``args.size`` made with ``seed``; also the plot's series."""
    from mlx_vlm.utils import load as reference_load

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import conversation_signal, make_checkpoint

    tmp = tempfile.TemporaryDirectory()
    checkpoint = make_checkpoint(Path(tmp.name) / f"{args.size}-s{seed}", args.size, seed=seed)
    model, processor = load(checkpoint)
    ref, ref_processor = reference_load(str(checkpoint))
    ours, theirs = model.create_session(processor), ref.create_session(ref_processor)
    rate, frame = model.config.input_sample_rate, model.config.frame_samples

    def signal(seconds: float) -> np.ndarray:
        return conversation_signal(seconds, rate)

    report: dict[str, Any] = {"size": args.size, "seed": seed, "backend": str(mx.default_device()),
                              "note": "random fixture weights; CPU figures on this machine"}
    if args.offline:
        audio = signal(args.seconds)
        warm = signal(1.0)
        ours.generate(warm, extra_decoding_seconds=0)
        theirs.generate(mx.array(warm), use_language_cache=True)
        offline = {
            "reference_default_s": _timed(lambda: theirs.generate(mx.array(audio))),
            "reference_cached_s": _timed(lambda: theirs.generate(mx.array(audio), use_language_cache=True)),
            "plugin_s": _timed(lambda: ours.generate(audio, extra_decoding_seconds=0.0)),
        }
        report["offline"] = {k: {"seconds": v[0], "peak_mb": v[1]} for k, v in offline.items()}
        report["offline"]["ratio_vs_reference_default"] = offline["plugin_s"][0] / offline["reference_default_s"][0]
        report["offline"]["ratio_vs_reference_cached"] = offline["plugin_s"][0] / offline["reference_cached_s"][0]
        print(json.dumps({"seed": seed, "offline": report["offline"]}, indent=1), flush=True)

    def start_ms(create: Callable[[], Any]) -> float:
        times = []
        for _ in range(5):
            began = time.perf_counter()
            create()
            times.append((time.perf_counter() - began) * 1e3)
        return float(np.median(times))

    report["session_start_ms"] = {
        "plugin": start_ms(lambda: ours.create_streaming_session()),
        "reference": start_ms(lambda: theirs.create_streaming_session()),
    }
    print(json.dumps({"seed": seed, "session_start_ms": report["session_start_ms"]}), flush=True)

    stream_audio = signal(args.frames * model.config.frame_duration)
    timed, ours_totals, ref_totals = _interleaved(ours, theirs, stream_audio, frame, args.rounds)
    from .floors import RateProbe, floors_ms, stage_table

    probe = RateProbe(repeats=100)  # the matmul rate around the profiled run
    probe.burst()
    ours_stream, _ = _stream_ours(ours, stream_audio, frame)  # profiled: stages, syncs
    probe.burst()
    ref_stream, _ = _stream_reference(theirs, stream_audio, frame)
    report["streaming"] = {
        "interleaved": timed, "plugin": ours_stream, "reference": ref_stream,
        "ratio_mean": timed["ratio_median"],
        "ratio_spread": [timed["ratio_min"], timed["ratio_max"]],
        "ratio_p95": timed["plugin_all"]["p95_ms"] / timed["reference_all"]["p95_ms"],
        "ratio_stages": {s: ours_stream["stages"][s]["mean_ms"] / ref_stream["stages"][s]["mean_ms"]
                         for s in STAGES},
    }
    report["floors"] = floors_ms(model, probe.rate)
    report["streaming"]["stage_vs_floor_ms"] = stage_table(
        {s: ours_stream["stages"][s]["mean_ms"] for s in STAGES}, report["floors"]["floor_ms"])
    print(json.dumps({"seed": seed, "stage_vs_floor_ms": report["streaming"]["stage_vs_floor_ms"],
                      "perception_floor_if_window_kv_recomputed_ms":
                          report["floors"]["floor_ms"]["perception_window_kv"]}, indent=1),
          flush=True)
    print(json.dumps({"seed": seed}
                     | {k: report["streaming"][k]
                        for k in ("ratio_mean", "ratio_spread", "ratio_p95", "ratio_stages")}
                     | {"plugin_round_means_ms": timed["plugin_round_means_ms"],
                        "reference_round_means_ms": timed["reference_round_means_ms"],
                        "plugin_mean_ms": timed["plugin_all"]["mean_ms"],
                        "reference_mean_ms": timed["reference_all"]["mean_ms"],
                        "host_syncs": ours_stream["host_syncs"],
                        "wait_ms": ours_stream["wait_ms"],
                        "async_eval_ms": ours_stream["async_eval_ms"]}, indent=1), flush=True)

    scaling = {}
    series = {}
    for seconds in [float(s) for s in args.scaling.split(",") if s]:
        long_audio = signal(seconds)
        _, totals = _stream_ours(ours, long_audio, frame, stages=False)
        _, ref_long = _stream_reference(theirs, long_audio, frame, stages=False)
        scaling[str(seconds)] = {"plugin": _stats(totals), "reference": _stats(ref_long)}
        series[seconds] = (totals, ref_long)
        print(json.dumps({f"scaling_{seconds:g}s": scaling[str(seconds)]}), flush=True)
    report["scaling"] = scaling
    tmp.cleanup()
    return report, {"ours_totals": ours_totals, "ref_totals": ref_totals,
                    "ours_stream": ours_stream, "ref_stream": ref_stream, "series": series}


def _across_seeds(reports: dict[int, dict]) -> dict[str, Any]:
    """The streaming headline of every fixture side by side, and the worst of them."""
    per_seed = {
        str(seed): {"ratio_median": r["streaming"]["ratio_mean"],
                    "ratio_spread": r["streaming"]["ratio_spread"],
                    "plugin_median_round_ms": float(np.median(
                        r["streaming"]["interleaved"]["plugin_round_means_ms"])),
                    "reference_median_round_ms": float(np.median(
                        r["streaming"]["interleaved"]["reference_round_means_ms"])),
                    "total_vs_floor": r["streaming"]["stage_vs_floor_ms"]["total"]["ratio"]}
        for seed, r in reports.items()
    }
    return {"per_seed": per_seed,
            "worst_ratio_median": max(v["ratio_median"] for v in per_seed.values()),
            "worst_total_vs_floor": max(v["total_vs_floor"] for v in per_seed.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare")
    parser.add_argument("--size", default="small", choices=("tiny", "small", "medium", "full"))
    parser.add_argument("--seeds", default="0",
                        help="fixture seeds, comma-separated: each is its own checkpoint of --size")
    parser.add_argument("--seconds", type=float, default=10.0, help="offline input length")
    parser.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                        help="time the offline runs (the reference's default path is slow)")
    parser.add_argument("--frames", type=int, default=125, help="streaming frames")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved streaming rounds")
    parser.add_argument("--scaling", default="5,20,60", help="streaming session lengths (s)")
    parser.add_argument("--out", default="build/bench")
    args = parser.parse_args(argv)
    check_output(parser, Path(args.out) / "compare.json", "--out")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds:
        parser.error("--seeds needs at least one seed")

    reports, plots = {}, {}
    for seed in seeds:
        reports[seed], plots[seed] = _fixture_report(args, seed)
    summary = _across_seeds(reports)
    print(json.dumps({"across_seeds": summary}, indent=1), flush=True)
    report: dict[str, Any] = {"size": args.size, "seeds": seeds, "across_seeds": summary,
                              "fixtures": {str(k): v for k, v in reports.items()}}
    # The plot shows the first fixture.
    first = plots[seeds[0]]
    ours_totals, ref_totals = first["ours_totals"], first["ref_totals"]
    ours_stream, ref_stream, series = first["ours_stream"], first["ref_stream"], first["series"]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install .[bench])", file=sys.stderr)
        return 0
    figure, axes = plt.subplots(1, 3, figsize=(17, 4))
    axes[0].plot(ours_totals, label="plugin total")
    axes[0].plot(ref_totals, label="reference total")
    axes[0].set(xlabel="frame", ylabel="ms", title=f"streaming per frame ({args.size}, CPU)")
    axes[0].legend()
    positions = np.arange(len(STAGES))
    for offset, (name, run) in zip((-0.2, 0.2), (("plugin", ours_stream), ("reference", ref_stream))):
        means = [run["stages"][s]["mean_ms"] for s in STAGES]
        axes[1].bar(positions + offset, means, width=0.4, label=name)
    axes[1].set_xticks(positions, STAGES)
    axes[1].set(ylabel="ms per frame (profiled run)", title="per stage")
    axes[1].legend()
    for seconds, (mine, theirs_) in series.items():
        axes[2].plot(mine, label=f"plugin {seconds:g}s")
        axes[2].plot(theirs_, "--", label=f"reference {seconds:g}s")
    axes[2].set(xlabel="frame", ylabel="ms", title="per-frame cost against session length")
    if series:
        axes[2].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "compare.png", dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
