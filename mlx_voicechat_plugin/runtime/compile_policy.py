"""When the plugin lets ``mx.compile`` build fused kernels.

On the CPU backend MLX compiles every fused kernel with the system C++
compiler the first time it meets it, and caches the result under
``<tmp>/mlx/<version>/cpu``. Measured on this project's 2-core Linux machine,
``make demo`` (tiny checkpoint, 64 frames), the ``generate`` step:

=============================  ========
compiled, cold kernel cache     44.1 s
compiled, warm kernel cache      1.04 s
not compiled                     1.28 s
=============================  ========

The outputs are identical (compiled steps are exact, ``tests/test_compiled_steps.py``).
So the policy is:

- GPU backends compile (their kernels build in milliseconds);
- on the CPU, short jobs (``generate``, ``demo``, the offline and ``--stream``
  CLI) run uncompiled unless ``--compile`` is given: a cold cache costs a
  minute, a warm one saves a fifth;
- on the CPU, the server compiles and warms the kernels at start-up, before
  ``/health`` reports ready, so no client waits for the compiler;
- whenever compiling with a cold cache, one line says what is happening.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

logger = logging.getLogger(__name__)


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def kernel_cache_dir() -> Path:
    """Where MLX's CPU backend keeps compiled kernels (``std::filesystem::temp_directory_path``)."""
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def kernel_cache_is_cold() -> bool:
    directory = kernel_cache_dir()
    return not directory.is_dir() or not any(directory.glob("*.so"))


def choose(requested: bool | None, *, long_running: bool) -> bool:
    """Whether to compile: ``requested`` if given, else the policy above."""
    if requested is not None:
        return requested
    return long_running or not on_cpu()


def apply(requested: bool | None, *, long_running: bool) -> bool:
    """Enable or disable ``mx.compile`` process-wide by the policy; returns the choice."""
    enabled = choose(requested, long_running=long_running)
    if enabled:
        mx.enable_compile()
        if on_cpu() and kernel_cache_is_cold():
            print(f"compiling MLX CPU kernels for this model (first run on this machine, "
                  f"cached in {kernel_cache_dir()}); this can take a minute",
                  file=sys.stderr, flush=True)
    else:
        mx.disable_compile()
    logger.debug("mx.compile %s", "enabled" if enabled else "disabled")
    return enabled
