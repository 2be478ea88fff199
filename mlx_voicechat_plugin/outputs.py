"""What a command may write: the one rule every path a command writes goes through.

Nothing a user did not ask to delete is deleted. A command writes a *file*
(``--output-audio``, ``--output-path``, a bench's ``--json``) only where no
folder stands and the folder it goes in can hold it; it writes a *checkpoint
folder* (``convert OUT``, ``demo --out``'s checkpoint) only where nothing
stands, or, with ``--force``, where a checkpoint of this model stands
(``config.json`` says ``nemotron_voicechat``) that holds nothing else, is not a
source of the same command and does not contain one. Each check runs before
any model loads, and says in one line what is in the way (:class:`OutputRefused`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from .checkpoint import MODEL_TYPE

# What a checkpoint folder of this model may hold besides files (a hub snapshot's
# download metadata is a hidden folder).
CHECKPOINT_FOLDERS = ("rnnt_tokenizer",)


class OutputRefused(ValueError):
    """An output path that would destroy what was not asked for; the message names the
    flag (or argument) and what is in the way."""


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


def check_output_file(path: str | Path, flag: str) -> Path:
    """``path`` as a file a command may write (an existing file is replaced, as the
    hosts' commands do; a folder never is); its folder is made if need be."""
    target = Path(path).expanduser()
    if str(path).endswith(os.sep) or target.is_dir():
        raise OutputRefused(f"{flag} {path} is a folder; name a file in it, e.g. "
                         f"{target / 'answer.wav' if 'audio' in flag else target / 'out'}")
    parent = target.parent
    existing = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise OutputRefused(f"{flag} {path}: {existing} is a file, not a folder")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise OutputRefused(f"{flag} {path}: the folder {existing} is not writable")
    return target


def is_checkpoint_of_this_model(folder: Path) -> bool:
    """Whether ``folder``'s ``config.json`` says ``nemotron_voicechat``."""
    try:
        values = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(values, dict) and values.get("model_type") == MODEL_TYPE


def check_output_folder(path: str | Path, flag: str, force: bool,
                        sources: Iterable[str | Path] = ()) -> Path:
    """``path`` as a checkpoint folder a command may write (see the module doc)."""
    target = Path(path).expanduser()
    out = _resolved(target)
    for source in sources:
        local = Path(source).expanduser()
        if not local.exists():
            continue  # a hub id: nothing of it lives here
        src = local.resolve()
        if _within(src, out):
            raise OutputRefused(f"{flag} {path} {'is' if src == out else 'contains'} the source "
                             f"{source}; write the output to another folder")
        if _within(out, src):
            raise OutputRefused(f"{flag} {path} is inside the source {source}; write the "
                             "output to another folder")
    if target.is_file() or target.is_symlink() and not target.is_dir():
        raise OutputRefused(f"{flag} {path} is a file, not a folder")
    if not target.exists() or not any(target.iterdir()):
        return target
    if not is_checkpoint_of_this_model(target):
        raise OutputRefused(f"{flag} {path} exists and holds files that are not a "
                         f"{MODEL_TYPE} checkpoint; choose a new folder (nothing was "
                         "deleted)")
    others = sorted(p.name for p in target.iterdir()
                    if p.is_dir() and p.name not in CHECKPOINT_FOLDERS
                    and not p.name.startswith("."))
    if others:
        raise OutputRefused(f"{flag} {path} holds folders that are not part of a checkpoint "
                         f"({', '.join(others)}); choose a new folder (nothing was deleted)")
    if not force:
        raise OutputRefused(f"{flag} {path} exists; pass --force to replace that checkpoint")
    return target
