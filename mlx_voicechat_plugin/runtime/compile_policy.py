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

- Metal compiles (its fused kernels build in milliseconds);
- CUDA is treated as the CPU: MLX's CUDA backend builds every fused kernel
  with NVRTC at its first use, once per kernel and shape (seconds for a
  whole model; the issue measured a tiny fixture's ``generate`` past 120 s),
  and caches the result under ``<tmp>/mlx/<version>/ptx``
  (``MLX_PTX_CACHE_DIR``). The compiled steps see one shape per batch size
  and stage, never one per position or cache length (the RoPE offset is an
  array input, the KV caches stay outside the compiled spans, the RNNT's
  later tries run every row in one shape), so a warm-up compiles everything a
  server will meet;
- on the CPU (and CUDA), short jobs (``generate``, ``demo``, the offline and ``--stream``
  CLI) compile only when this model's kernels are known to be in the cache
  (a compiled run of the same configuration finished before: the server's
  warm-up, or ``--compile``, leaves a marker there), else run uncompiled: a
  cold cache costs a minute, a warm one saves a fifth;
- on the CPU, the server compiles and warms the kernels at start-up, before
  ``/health`` reports ready, so no client waits for the compiler;
- whenever compiling with a cold cache, one line says what is happening.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlx.core as mx

logger = logging.getLogger(__name__)


def backend() -> str:
    """``"cpu"``, ``"cuda"`` or ``"metal"``: the backend of MLX's default device."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "metal"


# What a compiled kernel leaves in the cache, per backend that keeps one on disk.
_KERNEL_FILES = {"cpu": "*.so", "cuda": "*.ptx"}


def kernel_cache_dir() -> Path:
    """Where MLX keeps compiled kernels on this backend (``std::filesystem::temp_directory_path``
    based: ``cpu`` for the CPU backend, ``ptx`` or ``MLX_PTX_CACHE_DIR`` for CUDA)."""
    root = Path(tempfile.gettempdir()) / "mlx" / mx.__version__
    if backend() == "cuda":
        return Path(os.environ.get("MLX_PTX_CACHE_DIR") or root / "ptx")
    return root / "cpu"


def compiles_slowly() -> bool:
    """Whether a fused kernel's first build is slow here (CPU: the C++ compiler; CUDA: NVRTC)."""
    return backend() in _KERNEL_FILES


def kernel_cache_is_cold() -> bool:
    """No compiled kernel in the cache (a missing directory globs to nothing)."""
    return not any(kernel_cache_dir().glob(_KERNEL_FILES.get(backend(), "*.so")))


def model_key(config: dict) -> str:
    """A short stable key of a checkpoint's configuration (its kernels' shapes follow it)."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _marker(key: str) -> Path:
    return kernel_cache_dir() / f"mlx-voicechat-{key}.warm"


def is_warm(key: str | None) -> bool:
    return key is not None and _marker(key).is_file()


def mark_warm(key: str | None) -> None:
    """Record that a compiled run of this configuration finished (its kernels are cached)."""
    if key is None or not enabled():
        return
    try:
        kernel_cache_dir().mkdir(parents=True, exist_ok=True)
        _marker(key).touch()
    except OSError:  # a read-only temp dir: the next run just stays uncompiled
        logger.debug("could not write the warm-kernel marker", exc_info=True)


def choose(requested: bool | None, *, long_running: bool, key: str | None = None) -> bool:
    """Whether to compile: ``requested`` if given, else the policy above."""
    if requested is not None:
        return requested
    return long_running or not compiles_slowly() or is_warm(key)


def apply(requested: bool | None, *, long_running: bool, key: str | None = None) -> bool:
    """Enable or disable ``mx.compile`` process-wide by the policy; returns the choice."""
    enabled = choose(requested, long_running=long_running, key=key)
    if enabled:
        mx.enable_compile()
        if compiles_slowly() and kernel_cache_is_cold():
            print(f"compiling MLX {backend().upper()} kernels for this model "
                  f"(first run on this machine, "
                  f"cached in {kernel_cache_dir()}); this can take a minute",
                  file=sys.stderr, flush=True)
    else:
        mx.disable_compile()
    logger.debug("mx.compile %s", "enabled" if enabled else "disabled")
    return enabled


def enabled() -> bool:
    """Whether ``mx.compile`` is on (MLX has no getter): a probe function compiled here
    runs its Python body once when MLX compiles, at every call when it does not."""
    calls: list[None] = []

    def probe(x: mx.array) -> mx.array:
        calls.append(None)
        return x

    compiled = mx.compile(probe)
    x = mx.array(0)
    compiled(x)
    compiled(x)
    return len(calls) == 1


@contextmanager
def suspended() -> Iterator[None]:
    """``mx.compile`` off inside the block, then exactly as it was.

    A compiled function called inside runs its Python body (MLX checks the
    mode at each call), so whatever its body issues is seen from Python:
    what an instrument that patches ``mx`` functions needs. The cached
    traces stay; the next compiled call outside replays them.
    """
    previous = enabled()
    mx.disable_compile()
    try:
        yield
    finally:
        if previous:
            mx.enable_compile()
        else:
            mx.disable_compile()
