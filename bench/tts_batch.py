"""Time per frame of the EAR-TTS half for B sessions: one batch vs B single calls.

    python -m bench.tts_batch [--size small] [--sessions 1 2 4 8] [--frames 40]
                              [--repeats 3] [--json out.json]

Each of B sessions (seeds 0..B-1) first runs a different number of frames
alone, so that the batch mixes cache offsets (some past the sliding window).
From copies of that state, ``--frames`` frames are then timed two ways:
"batched" (``backbone_step_batch`` + ``generate_codes_batch``, one evaluation a
frame) and "single" (per session ``backbone_step`` + ``generate_codes`` as
``Timeline.speak`` runs them, each evaluated). Reported: milliseconds of wall
time per frame of all B sessions (best of ``--repeats``), per session, and the
speed-up. Every session's codes are checked equal between the two ways.
A benchmark script, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TEXT_IDS = (3, 17, 12, 2, 40, 5, 29, 11, 8)


class _Session:
    def __init__(self, tts: Any, cache: list, key: Any, prev: Any, frames: int):
        self.tts, self.cache, self.key, self.prev, self.frames = tts, cache, key, prev, frames

    def copy(self) -> "_Session":
        from mlx_voicechat_plugin.runtime.prompt_cache import clone_state

        return _Session(self.tts, clone_state(self.cache), self.key, self.prev, self.frames)

    def stream(self) -> Any:
        from mlx_voicechat_plugin.runtime.rng import RandomStream

        rng = RandomStream(0)
        rng._key = self.key
        return rng

    def text_id(self) -> int:
        return TEXT_IDS[self.frames % len(TEXT_IDS)]


def _single_frames(sessions: list[_Session], frames: int) -> tuple[float, list]:
    import mlx.core as mx

    rngs = [s.stream() for s in sessions]
    codes: list[list] = [[] for _ in sessions]
    started = time.perf_counter()
    for _ in range(frames):
        for b, (s, rng) in enumerate(zip(sessions, rngs)):
            t = s.text_id()
            hidden = s.tts.backbone_step(s.prev, mx.array([[t]], dtype=mx.int32), s.cache, t)
            mx.async_eval(hidden)
            s.prev = s.tts.generate_codes(hidden, rng)
            mx.eval(s.prev)
            s.frames += 1
            codes[b].append(s.prev)
    return time.perf_counter() - started, codes


def _batched_frames(sessions: list[_Session], frames: int) -> tuple[float, list]:
    import mlx.core as mx

    tts = sessions[0].tts
    rngs = [s.stream() for s in sessions]
    caches = [s.cache for s in sessions]
    codes: list[list] = [[] for _ in sessions]
    started = time.perf_counter()
    for _ in range(frames):
        ids = [s.text_id() for s in sessions]
        previous = mx.concatenate([s.prev for s in sessions], axis=0)
        text = mx.array(ids, dtype=mx.int32)[:, None]
        hidden = tts.backbone_step_batch(previous, text, caches, ids)
        mx.async_eval(hidden)
        out = tts.generate_codes_batch(hidden, rngs)
        mx.eval(out)
        for b, s in enumerate(sessions):
            s.prev = out[b : b + 1]
            s.frames += 1
            codes[b].append(s.prev)
    return time.perf_counter() - started, codes


def _sessions(model: Any, count: int) -> list[_Session]:
    """``count`` sessions after ``0, 9, 18, ...`` frames alone (different offsets)."""
    import mlx.core as mx

    from mlx_voicechat_plugin.runtime.rng import RandomStream
    from mlx_voicechat_plugin.runtime.timeline import warm_start

    start = warm_start(model)
    tts = model.tts_model.tts_model
    out = []
    for b in range(count):
        rng = RandomStream(b)
        s = _Session(tts, start.fresh_cache(), rng._key, start.prev_codes, 0)
        _, _ = _single_frames([s], 9 * b)  # advances s (its own stream copy)
        s.key = mx.random.key(b)  # a fresh seed for the timed part
        out.append(s)
    return out


def _same(a: list, b: list) -> bool:
    import mlx.core as mx

    return all(
        len(x) == len(y) and all(bool(mx.array_equal(p, q)) for p, q in zip(x, y))
        for x, y in zip(a, b)
    )


def measure(model: Any, count: int, frames: int, repeats: int) -> dict:
    base = _sessions(model, count)
    _batched_frames([s.copy() for s in base], 3)  # traces this batch size
    _single_frames([s.copy() for s in base], 3)
    single_t, batched_t, exact = [], [], True
    for _ in range(repeats):
        t, codes_single = _single_frames([s.copy() for s in base], frames)
        single_t.append(t)
        t, codes_batched = _batched_frames([s.copy() for s in base], frames)
        batched_t.append(t)
        exact = exact and _same(codes_single, codes_batched)
    single_ms, batched_ms = 1e3 * min(single_t) / frames, 1e3 * min(batched_t) / frames
    return {"sessions": count, "frames": frames, "single_ms_per_frame": single_ms,
            "batched_ms_per_frame": batched_ms, "speedup": single_ms / batched_ms,
            "exact": exact}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tts_batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=("tiny", "small", "medium"))
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
          f"{args.frames} frames, best of {args.repeats}")
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
