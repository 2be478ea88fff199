"""MLX's peak bytes of a pool's step after a session leaves, against a steady step.

    python -m bench.leave_peak [--size medium] [--sessions 4] [--frames 4]

A pool of ``--sessions`` conversations steps ``--frames`` frames together;
then one session is closed, cancelled or flushed (``StreamPool.close`` /
``cancel`` / ``flush``) and the others step once more. Printed per way of
leaving: the peak of MLX's active bytes above those before the step after it,
the last steady step's, and the leaving session's state bytes. The graphs of
both batch sizes are traced first in a pool of their own. A benchmark script,
never a timed test.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile

import mlx.core as mx


def _step(pool, audio, keys, frame: int, samples: int) -> int:
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    chunk = slice(frame * samples, (frame + 1) * samples)
    result = pool.step({k: audio[k][chunk] for k in keys})
    if result.errors:
        raise RuntimeError(f"a step failed: {result.errors}")
    return mx.get_peak_memory() - before


def measure(voicechat, sessions: int, frames: int, leave: str) -> tuple[int, int, int]:
    """(the step after ``leave``, the last steady step, the leaver's bytes) above active."""
    from mlx_voicechat_plugin.runtime.options import ConversationOptions
    from mlx_voicechat_plugin.runtime.pool import StreamPool
    from mlx_voicechat_plugin.testing.fixtures import question_signal

    keys = [str(i) for i in range(sessions)]
    samples = voicechat.config.frame_samples
    audio = {k: question_signal(samples * (frames + 2) / 16_000, seed=i)
             for i, k in enumerate(keys)}

    def pool_of() -> StreamPool:
        pool = StreamPool(voicechat, max_sessions=sessions)
        for i, k in enumerate(keys):
            pool.open(k, ConversationOptions(seed=i))
        return pool

    warm = pool_of()
    for frame in range(frames):
        _step(warm, audio, keys, frame, samples)
    warm.close(keys[0])
    _step(warm, audio, keys[1:], frames, samples)
    warm.close_all()
    pool = pool_of()
    steady = [_step(pool, audio, keys, frame, samples) for frame in range(frames)][-1]
    leaving = pool.nbytes(keys[0])
    getattr(pool, leave)(keys[0])
    after = _step(pool, audio, keys[1:], frames, samples)
    pool.close_all()
    return after, steady, leaving


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.leave_peak")
    parser.add_argument("--size", default="medium", choices=("tiny", "small", "medium", "full"))
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--frames", type=int, default=4)
    args = parser.parse_args(argv)
    from .kernels import load_fixture

    with tempfile.TemporaryDirectory() as tmp:
        model, processor = load_fixture(args.size, tmp=tmp)
        voicechat = model.create_session(processor)
        print(f"{args.size} fixture, a pool of {args.sessions}: MiB above active")
        for leave in ("close", "cancel", "flush"):
            after, steady, leaving = measure(voicechat, args.sessions, args.frames, leave)
            print(f"  {leave:6s} the step after {after / 2**20:6.2f}  steady "
                  f"{steady / 2**20:6.2f}  the leaver's state {leaving / 2**20:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
