"""Warm-up at start-up (``--compile``), on the engine thread before it serves: silent
streams at every batch size a client can meet.

One stream alone (through flush), then ``max_sessions`` streams stepped
together past the encoder's windows, closed one by one with a few steady
steps at each size, and the RNNT's graphs at every size (silence emits no
symbol, so its later tries would otherwise first compile when a client
speaks): every step size 1..max_sessions has been traced (and, on a cold
kernel cache, built; on CUDA by NVRTC) before the first client, and the
scheduler has its first measured step times. ``tests/test_compile_shapes.py``
checks that speech after the warm-up traces nothing new.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from ...runtime.options import ConversationOptions
from ...runtime.pool import StreamPool
from .scheduler import StepCosts

logger = logging.getLogger(__name__)

# Enough frames for the encoder's attention windows to fill on the released
# checkpoint (70 frames of left context), so the steady shapes are compiled too.
WARM_UP_FRAMES = 80
# Steady steps each batch size gets at warm-up (the codec's and RNNT's later shapes).
WARM_UP_STEPS_PER_SIZE = 3


def run_warm_up(voicechat: Any, max_sessions: int, costs: StepCosts, clear: Callable[[], None],
            frames: int = WARM_UP_FRAMES) -> tuple[int, ...]:
    """Run the silent streams; the batch sizes compiled. ``clear`` frees MLX's cache after."""
    logger.info("warm-up: compiling batch sizes 1-%d before the first session ...",
                max_sessions)
    started = time.perf_counter()
    stream = voicechat.create_streaming_session()
    stream.push_audio(np.zeros(frames * stream.frame_samples, np.float32))
    _warm_up_transcript(voicechat, stream, max_sessions)
    stream.flush()
    if max_sessions > 1:
        _warm_up_batches(voicechat, max_sessions, costs, frames)
    clear()
    logger.info("warm-up: batch sizes 1-%d compiled in %.1f s (%d silent frames each); "
                "steps of %s", max_sessions, time.perf_counter() - started, frames,
                ", ".join(f"{n}: {1000 * costs.by_size[n]:.0f} ms"
                          for n in sorted(costs.by_size)))
    from ...checkpoint import read_config
    from ...runtime import compile_policy

    path = getattr(voicechat.model, "model_path", None)
    if path is not None:  # later short CLI runs of this model may compile
        compile_policy.mark_warm(compile_policy.model_key(read_config(path)))
    return tuple(range(1, max_sessions + 1))


def _warm_up_transcript(voicechat: Any, stream: Any, max_sessions: int) -> None:
    """The RNNT's graphs at every batch size: silence emits nothing, so the tries
    after an emission (one shape per batch size) would otherwise first compile
    when a client speaks."""
    rnnt = stream.core.compute.rnnt
    if not rnnt.enabled or rnnt.carry is None:
        return
    width = voicechat.config.audio_config.encoder.d_model
    rnnt.greedy.warm(list(range(1, max_sessions + 1)), width, rnnt.carry.state[0].dtype)


def _warm_up_batches(voicechat: Any, max_sessions: int, costs: StepCosts, frames: int) -> None:
    pool = StreamPool(voicechat, max_sessions)
    silence = np.zeros(voicechat.config.frame_samples, np.float32)
    ids = [f"warm-up-{i}" for i in range(max_sessions)]
    try:
        for seed, session_id in enumerate(ids):
            pool.open(session_id, ConversationOptions(seed=seed))
        for _ in range(frames):
            result = pool.step({k: silence for k in ids})
        costs.record(len(ids), result.seconds)
        for size in range(max_sessions - 1, 0, -1):
            pool.close(ids[size])
            for _ in range(WARM_UP_STEPS_PER_SIZE):
                result = pool.step({k: silence for k in ids[:size]})
            costs.record(size, result.seconds)  # the scheduler's first figures
    finally:
        pool.close_all()
