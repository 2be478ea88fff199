"""Settings MLX's GPU backends read once, when the device is first created.

MLX's GPU backends commit their work in pieces: Metal ends a command buffer,
CUDA instantiates and launches the CUDA graph it has been recording, every
``N`` operations. ``N`` comes from the environment variable
``MLX_MAX_OPS_PER_BUFFER``, read the first time the backend needs it (at
device creation on Metal, at the first commit check on CUDA) and never again,
so it has to be in ``os.environ`` before any MLX GPU work: the commands set it
before the model loads. A larger ``N`` means fewer commits a step (each one
costs the GPU some idle time, about 20-30 us on CUDA), a smaller one an
earlier start of the GPU on a step's first operations; docs/gpu.md says how
to measure which wins. The CPU backend ignores it.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

GRAPH_COMMIT_ENV = "MLX_MAX_OPS_PER_BUFFER"
MAX_GRAPH_COMMIT_OPS = 100_000


def check_graph_commit_ops(n: int | None, flag: str = "--graph-commit-ops") -> None:
    """Raise ``ValueError`` naming ``flag`` unless ``n`` is None or 0..MAX_GRAPH_COMMIT_OPS."""
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_GRAPH_COMMIT_OPS:
        raise ValueError(f"{flag} must be an integer from 1 to {MAX_GRAPH_COMMIT_OPS} "
                         f"(0: MLX's default), got {n!r}")


def apply_graph_commit_ops(n: int | None) -> str | None:
    """Set ``MLX_MAX_OPS_PER_BUFFER`` to ``n`` (checked by :func:`check_graph_commit_ops`
    where the flag is parsed) for the GPU device not yet created.

    Returns the value set, or None when ``n`` is None or 0 (MLX's default: the
    environment is left as it was, a value already there included).
    """
    if not n:
        return None
    value = str(n)
    os.environ[GRAPH_COMMIT_ENV] = value
    logger.info("graph commit size: %s=%s (MLX commits GPU work every %s operations)",
                GRAPH_COMMIT_ENV, value, value)
    return value
