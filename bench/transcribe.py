"""Transcription only (perception + RNNT) against the full paths, in one process.

    python -m bench.transcribe --size small [--frames 125] [--seconds 10] [--rounds 3]
        [--out build/bench]

On one fixture checkpoint and one input it times:
- streaming: per-frame wall-clock (mean / p50 / p95) of one-frame
  ``push_audio`` on a text-only :class:`TranscriptionStream` and on a full
  :class:`ConversationStream`, both warmed first, in ``--rounds`` interleaved
  rounds (the order alternates); the headline is the median per-round ratio
  text-only / full;
- file transcription: audio seconds per wall second of
  :meth:`Transcriber.transcribe` and of a full offline ``generate`` on the same
  ``--seconds`` of input (nothing appended on either: ``generate`` with
  ``extra_decoding_seconds=0``), best of
  ``--rounds``;
- that the transcripts agree (text-only stream vs full stream; file vs
  ``generate``).
Results go to ``<out>/transcribe.json``. Benchmark figures, never test assertions.

    python -m bench.transcribe --memory --size tiny [--minutes 1 4 10] [--out build/bench]

``--memory``: the MLX peak memory of :meth:`Transcriber.transcribe` on a WAV
file of each length, each in its own process (:func:`memory_peak`: peak reset
after the load, so it counts the weights held and the transcription's own
arrays), and the spread of the peaks (largest / smallest - 1). Results go to
``<out>/transcribe-memory-<size>.json``.
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


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean_ms": float(np.mean(values)), "p50_ms": float(np.percentile(values, 50)),
            "p95_ms": float(np.percentile(values, 95))}


def _per_frame(make: Callable[[], Any], audio: np.ndarray, frame: int) -> tuple[list[float], str]:
    """Milliseconds of each one-frame ``push_audio``, and the stream's final transcript."""
    stream = make()
    times = []
    for start in range(0, len(audio) - frame + 1, frame):
        chunk = audio[start : start + frame]
        began = time.perf_counter()
        stream.push_audio(chunk)
        times.append((time.perf_counter() - began) * 1e3)
    stream.flush()
    return times, stream.transcript


def _best_seconds(run: Callable[[], Any], rounds: int) -> tuple[float, Any]:
    best, value = float("inf"), None
    for _ in range(rounds):
        mx.clear_cache()
        began = time.perf_counter()
        value = run()
        best = min(best, time.perf_counter() - began)
    return best, value


def memory_peak(checkpoint: str, wav: str) -> dict[str, Any]:
    """In this process: load ``checkpoint``, reset the peak, transcribe ``wav``; the peak."""
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.runtime.transcribe import Transcriber

    model, processor = load(checkpoint)
    transcriber = Transcriber(model.create_session(processor))
    mx.synchronize()
    loaded = mx.get_active_memory()
    mx.reset_peak_memory()
    began = time.perf_counter()
    result = transcriber.transcribe(wav)
    seconds = time.perf_counter() - began
    peak = mx.get_peak_memory()
    return {"audio_s": result.duration, "frames": result.frames, "wall_s": seconds,
            "loaded_bytes": loaded, "peak_bytes": peak, "above_load_bytes": peak - loaded,
            "tokens": len(result.tokens)}


def measure_in_processes(checkpoint: str | Path, seconds: list[float], workdir: str | Path
                         ) -> list[dict[str, Any]]:
    """:func:`memory_peak` of a WAV file of each length, each in a fresh process."""
    import subprocess

    from mlx_voicechat_plugin.runtime.audio import write_wav
    from mlx_voicechat_plugin.testing.fixtures import conversation_signal

    rows = []
    for length in seconds:
        wav = Path(workdir) / f"speech-{length:g}s.wav"
        write_wav(wav, conversation_signal(length), 16_000)
        out = subprocess.run(
            [sys.executable, "-m", "bench.transcribe", "--memory-child", str(checkpoint),
             str(wav)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        wav.unlink()
    return rows


def spread(rows: list[dict[str, Any]], key: str = "peak_bytes") -> float:
    """Largest over smallest, less one."""
    values = [row[key] for row in rows]
    return max(values) / min(values) - 1.0


def _memory(args: argparse.Namespace) -> int:
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_checkpoint(Path(tmp) / args.size, args.size)
        rows = measure_in_processes(checkpoint, [m * 60 for m in args.minutes], tmp)
    report = {"size": args.size, "backend": str(mx.default_device()),
              "minutes": args.minutes, "runs": rows, "peak_spread": spread(rows),
              "note": "random fixture weights; MLX peak after the load, each in its own process"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"transcribe-memory-{args.size}.json"
    path.write_text(json.dumps(report, indent=2))
    for minutes, row in zip(args.minutes, rows):
        print(f"[{args.size}] {minutes:g} min: peak {row['peak_bytes'] / 2**20:.1f} MiB "
              f"({row['above_load_bytes'] / 2**20:.1f} MiB above the load), "
              f"{row['wall_s']:.1f} s, {row['frames']} frames")
    print(f"[{args.size}] peak spread {report['peak_spread']:.1%}")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--memory-child"]:
        print(json.dumps(memory_peak(argv[1], argv[2])))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.transcribe")
    parser.add_argument("--size", default="small", choices=("tiny", "small", "medium", "full"))
    parser.add_argument("--frames", type=int, default=125, help="streaming frames per round")
    parser.add_argument("--seconds", type=float, default=10.0, help="file length")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="build/bench")
    parser.add_argument("--memory", action="store_true",
                        help="peak memory of file transcription at each of --minutes")
    parser.add_argument("--minutes", type=float, nargs="+", default=[1.0, 4.0, 10.0])
    args = parser.parse_args(argv)
    if args.memory:
        return _memory(args)

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.runtime.transcribe import Transcriber
    from mlx_voicechat_plugin.testing.fixtures import conversation_signal, make_checkpoint

    tmp = tempfile.TemporaryDirectory()
    checkpoint = make_checkpoint(Path(tmp.name) / args.size, args.size)
    model, processor = load(checkpoint)
    session = model.create_session(processor)
    transcriber = Transcriber(session)
    rate, frame = model.config.input_sample_rate, model.config.frame_samples

    def signal(seconds: float) -> np.ndarray:
        return conversation_signal(seconds, rate)

    report: dict[str, Any] = {"size": args.size, "backend": str(mx.default_device()),
                              "note": "random fixture weights; figures on this machine"}

    # Streaming: warm both (their compiled steady shapes included), then interleave.
    stream_audio = signal(args.frames * frame / rate)
    warm = signal(90 * frame / rate)
    _per_frame(transcriber.create_stream, warm, frame)
    _per_frame(session.create_streaming_session, warm, frame)
    sides = {"text_only": transcriber.create_stream, "full": session.create_streaming_session}
    runs: dict[str, list[list[float]]] = {name: [] for name in sides}
    transcripts: dict[str, str] = {}
    order = list(sides)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            times, transcripts[name] = _per_frame(sides[name], stream_audio, frame)
            runs[name].append(times)
    means = {name: [float(np.mean(t)) for t in times] for name, times in runs.items()}
    ratios = [a / b for a, b in zip(means["text_only"], means["full"])]
    report["streaming"] = {
        "frames": args.frames, "rounds": args.rounds,
        "text_only": _stats([t for run in runs["text_only"] for t in run]),
        "full": _stats([t for run in runs["full"] for t in run]),
        "ratio_median": float(np.median(ratios)), "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "transcripts_equal": transcripts["text_only"] == transcripts["full"],
    }

    # File transcription vs a full offline turn, on the same input.
    audio = signal(args.seconds)
    transcriber.transcribe(signal(1.0))
    session.generate(signal(1.0), extra_decoding_seconds=0.0)
    file_s, result = _best_seconds(lambda: transcriber.transcribe(audio), args.rounds)
    offline_s, turn = _best_seconds(
        lambda: session.generate(audio, extra_decoding_seconds=0.0), args.rounds)
    report["file"] = {
        "seconds_of_audio": args.seconds,
        "transcribe_s": file_s, "generate_s": offline_s,
        "transcribe_audio_s_per_s": args.seconds / file_s,
        "generate_audio_s_per_s": args.seconds / offline_s,
        "speedup": offline_s / file_s,
        "transcripts_equal": result.text == turn.user_transcript,
    }

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transcribe.json").write_text(json.dumps(report, indent=2))
    s, f = report["streaming"], report["file"]
    print(f"[{args.size}, {report['backend']}] streaming per frame: text-only "
          f"{s['text_only']['mean_ms']:.2f} ms (p95 {s['text_only']['p95_ms']:.2f}), full "
          f"{s['full']['mean_ms']:.2f} ms (p95 {s['full']['p95_ms']:.2f}); ratio "
          f"{s['ratio_median']:.3f} [{s['ratio_min']:.3f}, {s['ratio_max']:.3f}]; "
          f"transcripts equal: {s['transcripts_equal']}")
    print(f"file of {args.seconds:g} s: transcribe {f['transcribe_s']:.3f} s "
          f"({f['transcribe_audio_s_per_s']:.1f} audio s / s), generate {f['generate_s']:.3f} s "
          f"({f['generate_audio_s_per_s']:.1f} audio s / s), {f['speedup']:.1f}x; transcripts "
          f"equal: {f['transcripts_equal']}")
    print(f"wrote {out / 'transcribe.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
