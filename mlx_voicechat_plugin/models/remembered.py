"""What a load computes that depends only on the device and the checkpoint, remembered on disk.

Parts of a load used to be recomputed every time and grow with the model:
the fused-projection probe (:mod:`.fused`: whether the stacked product gives
the same bits, decided by the device's kernels for those shapes and dtypes,
never by the values) and the EAR-TTS warm start (a pure function of the
weights: the codec's encoding of the silent prompt and the backbone's
warm-up), and smaller ones of a session's start. All are kept in the user's
cache directory:

- ``fused-probe.json``: one verdict per device, MLX version and stack
  (:func:`device_key` and the stack's kind, dtypes and shapes);
- ``warm-start/<key>.safetensors``: the warm start's arrays and, in its
  metadata, how to rebuild its caches; the key hashes the checkpoint's
  identity (its path, each weight file's size and modification time,
  ``config.json``), the device, MLX's and this package's versions;
- ``window-positions/<key>.safetensors``: the streaming encoder's projected
  positional embeddings of its full window (a pure function of the weights,
  keyed the same way);
- in ``fused-probe.json`` too, the RNNT symbol table's probe (whether a table
  row is the bits a batch's product gives, :mod:`.prediction_step`).

``MLX_VOICECHAT_CACHE_DIR`` names the directory (default:
``$XDG_CACHE_HOME/mlx-voicechat`` or ``~/.cache/mlx-voicechat``); an empty
value or ``off`` turns remembering off. A file that cannot be read or
written is ignored (logged): remembering only ever saves time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

logger = logging.getLogger(__name__)

ENV_CACHE_DIR = "MLX_VOICECHAT_CACHE_DIR"
PROBE_FILE = "fused-probe.json"
WARM_START_DIR = "warm-start"
WINDOW_POSITIONS_DIR = "window-positions"


def cache_dir() -> Path | None:
    """Where remembered results live, or ``None`` when remembering is off."""
    value = os.environ.get(ENV_CACHE_DIR)
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0", "no") else Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-voicechat"


def device_key() -> str:
    """The running device and MLX version: what a kernel's choice depends on."""
    info = mx.device_info()
    name = info.get("device_name") or info.get("architecture") or ""
    return f"{mx.default_device()}|{name}|mlx {mx.__version__}"


def _write_atomically(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    os.close(handle)
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


class ProbeVerdicts:
    """The fused-product probe's verdicts on this device, read once and written back
    when a new one is added (:meth:`save`)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.verdicts: dict[str, bool] = {}
        self.added = 0
        if path is not None and path.is_file():
            try:
                self.verdicts = {str(k): bool(v) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError, AttributeError) as error:
                logger.warning("ignoring unreadable %s: %s", path, error)

    @classmethod
    def default(cls) -> "ProbeVerdicts":
        directory = cache_dir()
        return cls(None if directory is None else directory / PROBE_FILE)

    def verdict(self, key: str, probe: Callable[[], bool]) -> bool:
        """The remembered verdict on ``key`` on this device, else ``probe()``'s, remembered."""
        key = f"{device_key()}|{key}"
        if key not in self.verdicts:
            self.verdicts[key] = probe()
            self.added += 1
        return self.verdicts[key]

    def save(self) -> None:
        if self.path is None or not self.added:
            return
        text = json.dumps(self.verdicts, indent=1, sort_keys=True)
        try:
            _write_atomically(self.path, lambda temp: Path(temp).write_text(text))
        except OSError as error:
            logger.warning("could not remember the probe's verdicts in %s: %s", self.path, error)
        self.added = 0


def checkpoint_key(path: Path | None, *parts: str) -> str | None:
    """A digest of checkpoint ``path``'s identity with ``parts`` and :func:`device_key`
    (``None`` without a path: nothing to key on)."""
    if path is None or not Path(path).is_dir():
        return None
    from .. import __version__

    digest = hashlib.sha256()
    root = Path(path).resolve()
    digest.update(f"{root}|{device_key()}|plugin {__version__}".encode())
    for file in sorted(root.glob("*.safetensors")):
        stat = file.stat()
        digest.update(f"|{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    config = root / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for part in parts:
        digest.update(f"|{part}".encode())
    return digest.hexdigest()[:32]


def _arrays_path(kind: str, key: str | None) -> Path | None:
    """Where arrays are remembered under ``kind``/``key`` (``None``: nowhere)."""
    directory = cache_dir()
    return None if directory is None or key is None else directory / kind / f"{key}.safetensors"


def load_arrays(kind: str, key: str | None) -> tuple[list[mx.array], dict[str, str]] | None:
    """Arrays remembered under ``kind``/``key``, in order, and their metadata."""
    path = _arrays_path(kind, key)
    if path is None or not path.is_file():
        return None
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as error:
        logger.warning("ignoring unreadable %s: %s", path, error)
        return None
    return [arrays[str(i)] for i in range(len(arrays))], dict(metadata)


def save_arrays(kind: str, key: str | None, arrays: list[mx.array],
                metadata: dict[str, str]) -> None:
    path = _arrays_path(kind, key)
    if path is None:
        return
    named = {str(i): a for i, a in enumerate(arrays)}
    try:
        _write_atomically(path, lambda temp: mx.save_safetensors(temp, named, metadata))
    except (OSError, RuntimeError) as error:
        logger.warning("could not remember %s in %s: %s", kind, path, error)
