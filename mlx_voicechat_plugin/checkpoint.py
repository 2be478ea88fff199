"""A checkpoint folder as named: a local directory or a hub id, whole or not.

What every command checks before a model loads, so it imports no network: a
path that does not exist is ``no such checkpoint directory``, a folder that is
not this model's or not whole names the file and what is wrong.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODEL_TYPE = "nemotron_voicechat"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as named: no such folder, not this model,
    or not whole (the message names the file and what is wrong)."""


# A hub repository id: ``owner/name``, nothing before or after.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def is_hub_id(name: str | Path) -> bool:
    """Whether ``name``, which is not a local path that exists, reads as a hub id
    (``owner/name``); ``./x``, ``/x``, ``~/x``, ``a/b/c`` and bare names are paths."""
    text = str(name)
    return bool(_HUB_ID.match(text)) and not text.startswith((".", "~"))


def resolve_path(path_or_repo: str | Path) -> Path:
    """A local directory as is; a hub id (``owner/name``) fetched from the hub.

    A path that does not exist and is no hub id is ``no such checkpoint directory``;
    a hub that cannot provide the repository (offline, not found, gated) is one
    :class:`CheckpointError` with its reason."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path_or_repo} is a file; a checkpoint is a directory "
                                  "(config.json, *.safetensors, tokenizer files)")
        return path
    if not is_hub_id(path_or_repo):
        raise CheckpointError(f"no such checkpoint directory: {path_or_repo}")
    from huggingface_hub import snapshot_download

    logger.info("fetching %s from the hub", path_or_repo)
    try:
        return Path(snapshot_download(str(path_or_repo)))
    except Exception as error:  # the hub's own errors: not found, offline, gated
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path_or_repo} is no local directory, and the hub could not "
                              f"provide it: {reason}") from error


def read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json: not a checkpoint directory")
    try:
        values = json.loads(config_file.read_text())
    except ValueError as error:
        raise CheckpointError(f"{config_file} is not valid JSON ({error})") from None
    if not isinstance(values, dict) or values.get("model_type") != MODEL_TYPE:
        found = values.get("model_type") if isinstance(values, dict) else None
        raise CheckpointError(
            f"{config_file}: model_type is {found!r}, expected {MODEL_TYPE!r}"
        )
    return values


def check_checkpoint(path: Path) -> dict[str, Any]:
    """``path``'s config, once the checkpoint is whole: its config names this model and
    every shard its index names is there and as long as its header says (the checks
    ``convert`` runs on a source, :func:`~.conversion.source.read_tensors`)."""
    from .conversion.source import ConversionError, read_tensors

    config = read_config(path)
    try:
        tensors = read_tensors(path)
    except ConversionError as error:
        raise CheckpointError(str(error)) from None
    if not tensors:
        raise CheckpointError(f"{path} has no *.safetensors weights")
    return config
