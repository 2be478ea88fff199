"""Time per frame of the EAR-TTS half for B sessions: one batch vs B single calls.

    python -m bench.tts_batch [--size small] [--sessions 1 2 4 8] [--frames 40]
                              [--repeats 3] [--json out.json]

Each of B sessions (seeds 0..B-1) first runs a different number of frames
alone, so that the batch mixes cache offsets (some past the sliding window).
From two copies of that state, ``--frames`` frames are then run two ways,
interleaved frame by frame so that both see the same load on a shared
machine: "single" (per session ``backbone_step`` + ``generate_codes`` over
one row, each evaluated) and "batched" (the same two calls over all B rows,
one evaluation a frame).
Reported: the median wall time of one frame of all B sessions over
``--repeats`` rounds (after an untimed tracing round), per session, and the
speed-up. Every session's codes are checked equal between the two ways.
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
from typing import Any

TEXT_IDS = (3, 17, 12, 2, 40, 5, 29, 11, 8)  # as tests/test_batched_tts.py


class _TtsRows:
    def __init__(self, tts: Any, cache: list, key: Any, prev: Any, frames: int):
        self.tts, self.cache, self.key, self.prev, self.frames = tts, cache, key, prev, frames

    def copy(self) -> "_TtsRows":
        from mlx_voicechat_plugin.models.cache_state import (
            cache_meta_state,
            cache_state,
            caches_from_state,
            copy_arrays,
        )

        cache = caches_from_state(copy_arrays(cache_state(self.cache)), cache_meta_state(self.cache))
        return _TtsRows(self.tts, cache, self.key, self.prev, self.frames)

    def stream(self) -> Any:
        from mlx_voicechat_plugin.runtime.rng import RandomStream

        return RandomStream.from_state([self.key])

    def text_id(self) -> int:
        return TEXT_IDS[self.frames % len(TEXT_IDS)]


def _single_frame(sessions: list[_TtsRows], rngs: list[Any]) -> list:
    """One frame of every session alone (a batch of one each)."""
    import mlx.core as mx

    for s, rng in zip(sessions, rngs):
        t = s.text_id()
        hidden = s.tts.backbone_step(s.prev, mx.array([[t]], dtype=mx.int32), [s.cache], [t])
        mx.async_eval(hidden)
        s.prev = s.tts.generate_codes(hidden, [rng])
        mx.eval(s.prev)
        s.frames += 1
    return [s.prev for s in sessions]


def _batched_frame(sessions: list[_TtsRows], rngs: list[Any]) -> list:
    """One frame of all sessions in one batch."""
    import mlx.core as mx

    tts = sessions[0].tts
    ids = [s.text_id() for s in sessions]
    previous = mx.concatenate([s.prev for s in sessions], axis=0)
    text = mx.array(ids, dtype=mx.int32)[:, None]
    hidden = tts.backbone_step(previous, text, [s.cache for s in sessions], ids)
    mx.async_eval(hidden)
    out = tts.generate_codes(hidden, rngs)
    mx.eval(out)
    for b, s in enumerate(sessions):
        s.prev = out[b : b + 1]
        s.frames += 1
    return [s.prev for s in sessions]


def _sessions(model: Any, count: int) -> list[_TtsRows]:
    """``count`` sessions after ``0, 9, 18, ...`` frames alone (different offsets)."""
    import mlx.core as mx

    from mlx_voicechat_plugin.runtime.warm_start import WarmStart

    start = WarmStart.of(model)
    tts = model.tts_model.tts_model
    out = []
    for b in range(count):
        s = _TtsRows(tts, start.fresh_cache(), mx.random.key(1000 + b), start.prev_codes, 0)
        rngs = [s.stream()]
        for _ in range(9 * b):
            _single_frame([s], rngs)
        s.key = mx.random.key(b)  # a fresh seed for the timed part
        out.append(s)
    return out


def measure(model: Any, count: int, frames: int, repeats: int) -> dict:
    """Single and batched frames interleaved frame by frame (they share the
    machine's load), from the same start; the median frame of each."""
    import mlx.core as mx

    base = _sessions(model, count)
    single_t: list[float] = []
    batched_t: list[float] = []
    exact = True
    for repeat in range(repeats + 1):  # the first round traces: not timed
        alone, together = [s.copy() for s in base], [s.copy() for s in base]
        rngs_alone, rngs_together = [s.stream() for s in alone], [s.stream() for s in together]
        for _ in range(frames):
            started = time.perf_counter()
            want = _single_frame(alone, rngs_alone)
            middle = time.perf_counter()
            got = _batched_frame(together, rngs_together)
            ended = time.perf_counter()
            exact = exact and all(bool(mx.array_equal(a, b)) for a, b in zip(want, got))
            if repeat:
                single_t.append(middle - started)
                batched_t.append(ended - middle)
    single_ms = 1e3 * statistics.median(single_t)
    batched_ms = 1e3 * statistics.median(batched_t)
    return {"sessions": count, "frames": frames * repeats, "single_ms_per_frame": single_ms,
            "batched_ms_per_frame": batched_ms, "speedup": single_ms / batched_ms,
            "exact": exact}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tts_batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=("tiny", "small", "medium", "full"))
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import mlx.core as mx

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model, processor = load(make_checkpoint(Path(tmp) / args.size, args.size))
    model.create_session(processor)  # spells the vocabulary for the TTS
    rows = [measure(model, n, args.frames, args.repeats) for n in args.sessions]
    print(f"EAR-TTS half, {args.size} fixture, {mx.default_device()}, "
          f"median of {args.frames} x {args.repeats} frames")
    print(f"{'B':>3s} {'single ms/frame':>16s} {'batched ms/frame':>17s} "
          f"{'batched ms/session':>19s} {'speed-up':>9s} {'exact':>6s}")
    for r in rows:
        print(f"{r['sessions']:3d} {r['single_ms_per_frame']:16.2f} "
              f"{r['batched_ms_per_frame']:17.2f} "
              f"{r['batched_ms_per_frame'] / r['sessions']:19.2f} {r['speedup']:9.2f} "
              f"{str(r['exact']):>6s}")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "rows": rows}, indent=2))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
