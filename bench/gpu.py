"""The GPU bench: plugin and reference side by side at the released size, one process.

    python -m bench.gpu --size full --out bench-gpu.json --plot bench-gpu.png
        [--batches 1,2,4,8,16,32,64] [--frames 60] [--warm-frames 72] [--steps 20]
        [--tiny-seconds 3.1]

Sections, each written to ``--out`` as soon as it is measured (a run cut
short keeps what it measured):

1. ``single``: one session of each side streams a 3 s question's frames past
   ``--warm-frames`` (the encoder's 70-frame windows fill), then ``--frames``
   steady frames: plain ``push_audio`` wall-clock p50 / p95 per frame, and a
   profiled run's per-stage p50 (perception, RNNT, language, TTS, codec),
   with the plugin / reference ratios.
   ``agreement``: per stage, how the plugin's offline answer to a 3.1 s
   question agrees with the reference's on this device (``conformance.diff``:
   ids equal over the question, max abs of the float stages).
2. ``pool``: the plugin's :class:`~mlx_voicechat_plugin.runtime.pool.StreamPool`
   at each N of ``--batches``: N sessions stepped ``--warm-frames`` steps, then
   ``--steps`` timed steps: step p50 / p95, frames/s (N / p50), state bytes per
   session, peak memory, the kernels and evaluations of one counted step
   (:mod:`bench.kernels`), and whether session 0's ids and codes equal its
   run at N = 1 (batched rows against their solo run on this device).
   ``rows``: the same with sessions that started at different frames (their
   attention rings differ in length, so the batched core masks), with the
   batched attention cores and with the exact per-row ones.
3. ``tiny``: on the tiny fixture, both sides' offline ``generate`` and a
   streaming session over a ``--tiny-seconds`` question, wall-clock.

``--size tiny --batches 1,2`` runs the whole thing in seconds on a CPU (the
suite's smoke test). Figures, never test assertions; matplotlib is optional
(no plot without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from .compare import STAGES, _stats
from .kernels import SIZES
from . import check_output

QUESTION_SECONDS = 3.1  # the spoken question


def _log(message: str) -> None:
    print(f"[bench.gpu] {message}", flush=True)


class Report:
    """The JSON report, rewritten after every section."""

    def __init__(self, path: Path, **head: Any):
        self.path, self.data = path, dict(head)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1))


def _signal(seconds: float, rate: int) -> np.ndarray:
    from mlx_voicechat_plugin.testing.fixtures import conversation_signal, question_signal

    question = question_signal(QUESTION_SECONDS, sample_rate=rate)
    tail = conversation_signal(max(seconds - QUESTION_SECONDS, 0.0) + 1.0, rate)
    return np.concatenate([question, tail])[: int(seconds * rate)]


def _frame_times(push: Callable[[np.ndarray], Any], audio: np.ndarray, frame: int) -> list[float]:
    times = []
    for start in range(0, len(audio) - frame + 1, frame):
        chunk = audio[start : start + frame]
        began = time.perf_counter()
        push(chunk)
        times.append((time.perf_counter() - began) * 1e3)
    return times


def single_session(ours: Any, theirs: Any, audio: np.ndarray, frame: int, skip: int) -> dict:
    """Steady frame p50/p95 and per-stage p50 of one session, both sides."""
    out: dict[str, Any] = {}
    for name, session, wrap in (("plugin", ours, lambda x: x), ("reference", theirs, mx.array)):
        stream = session.create_streaming_session()
        times = _frame_times(lambda x: stream.push_audio(wrap(x)), audio, frame)[skip:]
        stream.flush()
        profiled = session.create_streaming_session(profile=True)
        _frame_times(lambda x: profiled.push_audio(wrap(x)), audio, frame)
        frames = (profiled.profile() if name == "plugin" else profiled.profile).frames[skip:]
        profiled.flush()
        if name == "plugin":
            stages = {s: _stats([f.stages_ms.get(s, 0.0) for f in frames]) for s in STAGES}
        else:
            stages = {s: _stats([getattr(f, f"{s}_ms") for f in frames]) for s in STAGES}
        out[name] = {"frame": _stats(times), "frames": len(times),
                     "stages_p50_ms": {s: v["p50_ms"] for s, v in stages.items()}}
        _log(f"single {name}: frame p50 {out[name]['frame']['p50_ms']:.1f} ms, "
             f"p95 {out[name]['frame']['p95_ms']:.1f} ms; stages p50 "
             + ", ".join(f"{s} {v:.1f}" for s, v in out[name]["stages_p50_ms"].items()))
    ours_f, ref_f = out["plugin"]["frame"], out["reference"]["frame"]
    out["ratio_p50"] = ours_f["p50_ms"] / ref_f["p50_ms"]
    out["ratio_p95"] = ours_f["p95_ms"] / ref_f["p95_ms"]
    out["ratio_stages_p50"] = {
        s: out["plugin"]["stages_p50_ms"][s] / max(out["reference"]["stages_p50_ms"][s], 1e-9)
        for s in STAGES}
    return out


def agreement(loaded: tuple, seconds: float, rate: int) -> dict:
    """How the plugin agrees with the reference on this device, per stage
    (``conformance.diff``: offline, one question, the reference with its language cache)."""
    from conformance.diff import run_pair

    from mlx_voicechat_plugin.testing.fixtures import question_signal

    audio = mx.array(question_signal(seconds, sample_rate=rate))
    diffs = run_pair(None, audio, extra_decoding_seconds=0.0, reference_language_cache=True,
                     loaded=loaded)
    out = {d.stage: {"equal": d.equal, "total": d.total, "first_mismatch": d.first_mismatch,
                     "max_abs": d.max_abs, "tolerance": d.tolerance} for d in diffs}
    _log("agreement: " + ", ".join(f"{k} {v['equal']}/{v['total']}" for k, v in out.items()))
    return out


def _event_key(event: Any) -> tuple:
    """An event as comparable host values (arrays as lists)."""
    values = []
    for field in dataclasses.fields(event):
        value = getattr(event, field.name)
        values.append(value.tolist() if hasattr(value, "tolist") else value)
    return (type(event).__name__, *values)


def pool_curve(voicechat: Any, batches: list[int], warm: int, steps: int, frame: int,
               rate: int, report: Report) -> list[dict]:
    """The pool's step time, throughput, memory and kernels against N."""
    from mlx_voicechat_plugin.instruments.kernels import KernelCounter
    from mlx_voicechat_plugin.runtime.options import ConversationOptions
    from mlx_voicechat_plugin.runtime.pool import StreamPool

    audio = _signal((warm + steps + 2) * frame / rate, rate)
    rows: list[dict] = []
    solo: list | None = None
    for n in batches:
        mx.clear_cache()
        mx.reset_peak_memory()
        pool = StreamPool(voicechat, max_sessions=n)
        ids = [str(i) for i in range(n)]
        for i in ids:
            pool.open(i, ConversationOptions(seed=int(i)))
        per_session = pool.state_bytes / n
        times, trace = [], []
        counted: dict[str, Any] = {}
        try:
            for index in range(warm + steps + 1):
                chunk = audio[index * frame : (index + 1) * frame]
                frames = {k: chunk for k in ids}  # every session hears the question
                if index == warm + steps:
                    with KernelCounter() as counter:
                        result = pool.step(frames)
                    counted = counter.snapshot()
                else:
                    result = pool.step(frames)
                if result.errors:
                    raise RuntimeError(f"N={n} step {index}: {result.errors}")
                if index >= warm and index < warm + steps:
                    times.append(result.seconds * 1e3)
                trace.append([_event_key(e) for e in result.events["0"]])
        finally:
            state_after = pool.state_bytes / max(len(pool), 1)
            pool.close_all()
        if solo is None:
            solo = trace
        p50 = float(np.percentile(times, 50))
        row = {"sessions": n, "step": _stats(times), "frames_per_s": n * 1e3 / p50,
               "real_time": p50 <= 80.0, "state_bytes_per_session_start": per_session,
               "state_bytes_per_session_end": state_after,
               "peak_memory_bytes": mx.get_peak_memory(),
               "kernels_per_step": counted.get("kernels"),
               "evaluations_per_step": counted.get("evaluations"),
               "row0_equals_solo": trace == solo}
        rows.append(row)
        report.put("pool", rows)
        _log(f"pool N={n}: step p50 {row['step']['p50_ms']:.1f} ms p95 {row['step']['p95_ms']:.1f} "
             f"ms, {row['frames_per_s']:.0f} frames/s, state {per_session / 2**20:.1f} MiB/session, "
             f"peak {row['peak_memory_bytes'] / 2**30:.2f} GiB, kernels {row['kernels_per_step']}, "
             f"row 0 = solo {row['row0_equals_solo']}")
    return rows


def row_agreement(voicechat: Any, frame: int, rate: int, sessions: int = 4,
                  frames: int = 48, stagger: int = 6) -> dict:
    """Batched rows against their solo runs when the sessions started at different frames
    (their rings differ in length, so the batched attention core masks the shorter ones):
    whether session 0's ids and codes equal its solo run, with the batched cores and with
    the exact per-row cores (``MLX_VOICECHAT_PER_ROW_ATTENTION``), and the largest sample
    difference."""
    from mlx_voicechat_plugin.runtime.options import ConversationOptions
    from mlx_voicechat_plugin.runtime.pool import StreamPool

    audio = _signal((frames + 1) * frame / rate, rate)

    def run(count: int) -> list:
        pool = StreamPool(voicechat, max_sessions=count)
        trace: list = []
        try:
            for index in range(frames + (count - 1) * stagger):
                for s in range(count):
                    if index == s * stagger:
                        pool.open(str(s), ConversationOptions(seed=0))
                chunk = {str(s): audio[(index - s * stagger) * frame:][:frame]
                         for s in range(count) if s * stagger <= index < s * stagger + frames}
                result = pool.step(chunk)
                if result.errors:
                    raise RuntimeError(f"rows: step {index}: {result.errors}")
                trace += [_event_key(e) for e in result.events.get("0", [])]
        finally:
            pool.close_all()
        return trace

    def samples(trace: list) -> np.ndarray:
        return np.concatenate([np.asarray(v, np.float32).ravel() for e in trace for v in e[1:]
                               if isinstance(v, list) and len(v) > 64] or [np.zeros(0)])

    out: dict[str, Any] = {"sessions": sessions, "stagger_frames": stagger}
    try:
        for name, batched in (("batched", True), ("per_row", False)):
            voicechat.model.set_batched_cores(batched)
            solo, many = run(1), run(sessions)
            a, b = samples(solo), samples(many)
            same = a.shape == b.shape
            out[name] = {"row0_equals_solo": many == solo,
                         "max_abs_samples": float(np.abs(a - b).max()) if same and a.size else None}
    finally:
        voicechat.model.set_batched_cores(None)
    _log(f"rows (staggered starts): batched row 0 = solo {out['batched']['row0_equals_solo']}, "
         f"per-row {out['per_row']['row0_equals_solo']}")
    return out


def tiny_runs(seconds: float, tmp: Path) -> dict:
    """Offline ``generate`` and one streaming session on the tiny fixture, both sides."""
    from mlx_vlm.utils import load as reference_load

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint, question_signal

    from mlx_voicechat_plugin.runtime import compile_policy

    checkpoint = make_checkpoint(tmp / "tiny-s0", "tiny")
    # As a user's short job runs it (``generate``, ``--stream``): the short-job policy.
    compiled = compile_policy.apply(None, long_running=False)
    model, processor = load(checkpoint)
    ref, ref_processor = reference_load(str(checkpoint))
    ours, theirs = model.create_session(processor), ref.create_session(ref_processor)
    audio = question_signal(seconds)
    frame = model.config.frame_samples
    out: dict[str, Any] = {"seconds_of_audio": seconds, "compiled": compiled}

    def timed(run: Callable[[], Any]) -> float:
        began = time.perf_counter()
        run()
        return time.perf_counter() - began

    def stream(session: Any, wrap: Callable) -> None:
        s = session.create_streaming_session()
        _frame_times(lambda x: s.push_audio(wrap(x)), audio, frame)
        s.flush()

    out["plugin_generate_s"] = timed(lambda: ours.generate(audio))
    out["reference_generate_s"] = timed(lambda: theirs.generate(mx.array(audio)))
    out["plugin_stream_s"] = timed(lambda: stream(ours, lambda x: x))
    out["reference_stream_s"] = timed(lambda: stream(theirs, mx.array))
    _log("tiny: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items() if k != "compiled")
         + f" (compiled: {compiled})")
    return out


def plot(data: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib not installed: no plot")
        return
    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    single = data.get("single")
    if single:
        positions = np.arange(len(STAGES))
        for offset, name in ((-0.2, "plugin"), (0.2, "reference")):
            axes[0].bar(positions + offset, [single[name]["stages_p50_ms"][s] for s in STAGES],
                        width=0.4, label=name)
        axes[0].set_xticks(positions, STAGES)
        axes[0].set(ylabel="ms per frame (p50)", title=f"one session, {data['size']}, {data['device']}")
        axes[0].legend()
    pool = data.get("pool")
    if pool:
        n = [r["sessions"] for r in pool]
        axes[1].plot(n, [r["step"]["p50_ms"] for r in pool], "o-", label="step p50 (ms)")
        axes[1].plot(n, [r["step"]["p95_ms"] for r in pool], "s--", label="step p95 (ms)")
        axes[1].axhline(80.0, color="grey", lw=0.8, label="80 ms: real time")
        axes[1].set_xscale("log", base=2)
        axes[1].set(xlabel="sessions N", ylabel="ms", title="StreamPool step against N")
        twin = axes[1].twinx()
        twin.plot(n, [r["frames_per_s"] for r in pool], "g^:", label="frames/s")
        twin.set_ylabel("frames / s")
        axes[1].legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    _log(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="full", choices=SIZES)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--frames", type=int, default=60, help="steady frames timed (one session)")
    parser.add_argument("--warm-frames", type=int, default=72,
                        help="frames before timing (the encoder's windows fill in 70)")
    parser.add_argument("--steps", type=int, default=20, help="timed pool steps per N")
    parser.add_argument("--tiny-seconds", type=float, default=QUESTION_SECONDS)
    parser.add_argument("--no-tiny", dest="tiny", action="store_false",
                        help="skip the tiny-fixture generate / stream timings")
    parser.add_argument("--no-agreement", dest="agreement", action="store_false",
                        help="skip the per-stage plugin / reference diff on this device")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="override the compile policy (default: the server's choice)")
    parser.add_argument("--out", default="bench-gpu.json")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    check_output(parser, args.out, "--out")
    check_output(parser, args.plot, "--plot")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]

    from mlx_vlm.utils import load as reference_load

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.runtime import compile_policy
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint

    compiled = compile_policy.apply(args.compile, long_running=True)
    report = Report(Path(args.out), size=args.size, device=str(mx.default_device()),
                    mlx=mx.__version__, compile=compiled, batches=batches)
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        checkpoint = make_checkpoint(Path(tmp) / f"{args.size}-s0", args.size)
        report.put("build_s", time.perf_counter() - began)
        _log(f"{args.size} fixture built in {report.data['build_s']:.1f} s on {mx.default_device()}")
        began = time.perf_counter()
        model, processor = load(checkpoint)
        ref, ref_processor = reference_load(str(checkpoint))
        ours, theirs = model.create_session(processor), ref.create_session(ref_processor)
        report.put("load_s", time.perf_counter() - began)
        _log(f"both sides loaded in {report.data['load_s']:.1f} s; "
             f"active memory {mx.get_active_memory() / 2**30:.2f} GiB")
        rate, frame = model.config.input_sample_rate, model.config.frame_samples
        audio = _signal((args.warm_frames + args.frames) * model.config.frame_duration, rate)
        report.put("single", single_session(ours, theirs, audio, frame, args.warm_frames))
        if args.agreement:
            try:
                report.put("agreement", agreement(((model, processor), (ref, ref_processor)),
                                                  QUESTION_SECONDS, rate))
            except Exception as exc:  # a diff that fails must not cost the batch curve
                report.put("agreement", {"error": repr(exc)})
                _log(f"agreement failed: {exc!r}")
        del ref, ref_processor, theirs
        mx.clear_cache()
        pool_curve(ours, batches, args.warm_frames, args.steps, frame, rate, report)
        report.put("rows", row_agreement(ours, frame, rate))
        del model, ours
        mx.clear_cache()
        if args.tiny:
            report.put("tiny", tiny_runs(args.tiny_seconds, Path(tmp)))
    if args.plot:
        plot(report.data, Path(args.plot))
    _log(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
