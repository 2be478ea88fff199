"""A checkpoint to convert: which layout it is in, its runtime config, its tensors.

Two layouts are read: an MLX conversion (``config.json`` with ``model_type``
``nemotron_voicechat``: this package's own layout, bf16 or quantized) and
NVIDIA's original release (:mod:`.release`). Tensors are listed from the
safetensors headers, never loaded here; a shard the index names but the
folder lacks, or a file shorter than its header, is a
:class:`ConversionError` naming it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import MODEL_TYPE
from .safetensors_io import CheckpointFileError, TensorEntry, read_header

logger = logging.getLogger(__name__)

MLX_LAYOUT, RELEASE_LAYOUT = "mlx", "nvidia-release"
INDEX_FILE = "model.safetensors.index.json"
RNNT_TOKENIZER_DIR = "rnnt_tokenizer"
_QUANTIZATION_KEYS = ("quantization", "quantization_config")


class ConversionError(ValueError):
    """A conversion that cannot go on; the message names what and where."""


@dataclass(frozen=True)
class TensorSpec:
    """A source tensor's dtype (safetensors name) and shape; ``entry`` where it lies
    (None: known from a config alone, for a dry run)."""

    dtype: str
    shape: tuple[int, ...]
    entry: TensorEntry | None = None

    @property
    def nbytes(self) -> int:
        """Bytes in the source file (0 for a tensor known from a config alone)."""
        return 0 if self.entry is None else self.entry.nbytes


@dataclass
class Source:
    path: Path
    layout: str
    config: dict[str, Any]  # the runtime config.json, without quantization
    quantization: dict[str, Any] | None  # how the source's quantized layers are stored
    tensors: dict[str, TensorSpec]
    tokenizer: Path | None  # where the LLM tokenizer files are
    weights_present: bool = True


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ConversionError(f"{path}: unreadable {what} ({error})") from None


def weight_files(path: Path) -> list[Path]:
    """The shards of ``path``: those its index names (each must exist), or every
    ``*.safetensors`` where there is no index."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{index}: no weight_map")
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise ConversionError(f"{path}: missing shard(s) {', '.join(missing)} "
                                  f"named by {INDEX_FILE}")
        return [path / name for name in names]
    return sorted(path.glob("*.safetensors"))


def read_tensors(path: Path) -> dict[str, TensorSpec]:
    """Every tensor of the checkpoint at ``path``, from its shards' headers."""
    tensors: dict[str, TensorSpec] = {}
    for file in weight_files(path):
        try:
            entries, _ = read_header(file)
        except CheckpointFileError as error:
            raise ConversionError(str(error)) from None
        for name, entry in entries.items():
            if name in tensors:
                raise ConversionError(f"{path}: tensor {name} is in more than one shard")
            tensors[name] = TensorSpec(entry.dtype, entry.shape, entry)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, "safetensors index")["weight_map"]
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise ConversionError(f"{path}: {len(absent)} tensor(s) the index names are in no "
                                  f"shard, e.g. {absent[0]} (in {weight_map[absent[0]]})")
    return tensors


def open_source(path: str | Path, tokenizer: str | Path | None = None,
                allow_config_only: bool = False) -> Source:
    """The checkpoint at ``path`` in either layout. ``tokenizer``: the Nemotron Nano
    9B v2 folder or hub id, for the release layout (default
    :data:`~.release.BASE_TOKENIZER_REPO`). ``allow_config_only``: a folder with a
    config and no weights is accepted (a dry run sizes the parts from the config's
    shapes)."""
    from .release import is_release_config, runtime_config  # the networks' configs

    path = _local(path)
    if not path.is_dir():
        raise ConversionError(f"source {path} is not a folder")
    config_file = path / "config.json"
    values = _read_json(config_file, "config.json") if config_file.is_file() else {}
    if values.get("model_type") == MODEL_TYPE:
        layout = MLX_LAYOUT
        config = {k: v for k, v in values.items() if k not in _QUANTIZATION_KEYS}
        quantization = values.get("quantization") or values.get("quantization_config")
        tokenizer_dir: Path | None = path
    elif is_release_config(values):
        layout = RELEASE_LAYOUT
        tokenizer_dir = _tokenizer_folder(tokenizer)
        base = _read_json(tokenizer_dir / "config.json", "Nemotron-H config.json")
        config = runtime_config(values, base)
        quantization = config.pop("quantization", None)
    else:
        raise ConversionError(
            f"{path} is neither an MLX conversion (config.json with model_type "
            f"{MODEL_TYPE!r}) nor NVIDIA's release layout (config.json with model.stt and "
            "model.speech_generation)")
    tensors = read_tensors(path)
    if not tensors and not allow_config_only:
        raise ConversionError(f"{path}: no safetensors weights")
    if layout == RELEASE_LAYOUT and tensors and not (path / RNNT_TOKENIZER_DIR).is_dir():
        raise ConversionError(f"{path}: missing {RNNT_TOKENIZER_DIR}/ (the RNNT tokenizer)")
    logger.info("%s: %s layout, %d tensors", path, layout, len(tensors))
    return Source(path, layout, config, quantization, tensors, tokenizer_dir,
                  weights_present=bool(tensors))


def _local(path: str | Path) -> Path:
    """A local folder as is; a hub id (``owner/name``) is fetched; the loader's rule
    (:func:`~..checkpoint.resolve_path`), its errors as conversion errors."""
    from ..checkpoint import CheckpointError, resolve_path

    local = Path(path).expanduser()
    if local.exists():
        return local
    try:
        return resolve_path(str(path))
    except CheckpointError as error:
        raise ConversionError(f"source: {error}") from None


def _tokenizer_folder(tokenizer: str | Path | None) -> Path:
    from .release import BASE_TOKENIZER_REPO

    name = tokenizer or BASE_TOKENIZER_REPO
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConversionError(f"tokenizer folder {local} has no config.json (the "
                                  "Nemotron-H config of the LLM)")
        return local
    from huggingface_hub import snapshot_download

    from .release import TOKENIZER_FILES

    logger.info("fetching the LLM tokenizer from %s", name)
    return Path(snapshot_download(str(name), allow_patterns=["config.json", *TOKENIZER_FILES]))
