"""Convert a checkpoint (NVIDIA's release or an MLX conversion) to a precision profile.

:func:`convert` writes into a temporary folder beside ``out`` and renames it
to ``out`` only when every shard, the config, the tokenizers and the model
card are written: an error at any point (a missing shard, a truncated file,
a full disk) removes the temporary folder and leaves no ``out``. Tensors are
read, converted and written one step at a time (:mod:`.plan`), so memory
stays near the largest tensor whatever the checkpoint's size.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..outputs import OutputRefused, check_output_folder
from ..profiles import CONFIG_KEY, PARTS, Profile, get_profile
from .plan import MAX_SHARD_BYTES, Plan, make_plan, run_step, tensors_from_config
from .release import TOKENIZER_FILES
from .safetensors_io import ShardWriter, read_tensor
from .source import (
    INDEX_FILE,
    MLX_LAYOUT,
    RELEASE_LAYOUT,
    RNNT_TOKENIZER_DIR,
    ConversionError,
    Source,
    open_source,
)

logger = logging.getLogger(__name__)

CARD_FILE = "README.md"
LAYOUT_NAMES = {MLX_LAYOUT: "an MLX conversion", RELEASE_LAYOUT: "NVIDIA's release layout"}
_WEIGHT_FILES = ("*.safetensors", INDEX_FILE)


@dataclass
class Conversion:
    """What a conversion wrote: the plan and the bytes per part measured on write."""

    out: Path
    plan: Plan
    written: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.written.values())


def plan_conversion(src: str | Path, profile: "str | Profile", tokenizer: str | None = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> tuple[Source, Plan]:
    """Read ``src``'s layout and headers and plan it under ``profile`` (nothing written).
    A source with a config and no weights is sized from the config's shapes."""
    profile = get_profile(profile)
    source = open_source(src, tokenizer, allow_config_only=True)
    if not source.weights_present:
        source.tensors = tensors_from_config(source.config)
    return source, make_plan(source, profile, max_shard_bytes)


def describe(source: Source, plan: Plan) -> str:
    """The dry run's table: each part with its format and bytes, then the total."""
    lines = [f"profile {plan.profile.name}: {plan.profile.description}",
             f"source {source.path} ({LAYOUT_NAMES[source.layout]}"
             + ("" if source.weights_present else "; no weights: sized from config.json shapes")
             + ")"
             + (f"; {plan.kept} layers already quantized are kept" if plan.kept else ""),
             f"{'part':14s} {'format':28s} {'bytes':>16s} {'GiB':>8s}"]
    formats = plan.part_formats()
    for name, size in plan.part_bytes().items():
        lines.append(f"{name:14s} {formats[name]:28s} {size:>16,d} {size / 2**30:>8.3f}")
    total = plan.total_bytes
    lines.append(f"{'total':14s} {'':28s} {total:>16,d} {total / 2**30:>8.3f}")
    lines.append(f"{len(plan.shards)} shard(s)")
    return "\n".join(lines)


class _Progress:
    """tqdm over bytes where it is installed, else a line on stderr now and then."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self._shown = total, 0, enabled, -1
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="converting",
                            file=sys.stderr)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            return
        percent = 100 * self.done // max(self.total, 1)
        if self.enabled and percent // 10 != self._shown:
            self._shown = percent // 10
            print(f"converting: {percent}% ({self.done / 2**30:.2f} of "
                  f"{self.total / 2**30:.2f} GiB)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _write_weights(source: Source, plan: Plan, folder: Path,
                   progress: _Progress) -> dict[str, int]:
    """Every shard of ``plan`` into ``folder``; returns the bytes written per part."""
    written = {part.name: 0 for part in PARTS}
    weight_map: dict[str, str] = {}
    def read(name: str) -> mx.array:
        entry = source.tensors[name].entry
        assert entry is not None, "a planned source tensor has a file"
        return read_tensor(entry)

    for name, steps in zip(_shard_names(len(plan.shards)), plan.shards):
        planned = [t for s in steps for t in s.outputs]
        with ShardWriter(folder / name, planned, metadata={"format": "mlx"}) as writer:
            for step in steps:
                arrays = run_step(step, read)
                mx.eval(list(arrays.values()))
                for tensor in step.outputs:
                    written[step.part] += writer.write(tensor.name, arrays[tensor.name])
                    weight_map[tensor.name] = name
                progress.update(sum(source.tensors[i].nbytes for i in step.inputs))
                del arrays
    index = {"metadata": {"total_size": sum(written.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return {k: v for k, v in written.items() if v}


def _copy_side_files(source: Source, folder: Path) -> None:
    """Tokenizers and other small files; never the source's weights, config or card."""
    rnnt = source.path / RNNT_TOKENIZER_DIR
    if rnnt.is_dir():
        shutil.copytree(rnnt, folder / RNNT_TOKENIZER_DIR)
    if source.layout == MLX_LAYOUT:
        for item in source.path.iterdir():
            if (item.is_file() and item.name not in ("config.json", CARD_FILE)
                    and not any(item.match(p) for p in _WEIGHT_FILES)):
                shutil.copy2(item, folder / item.name)
        return
    assert source.tokenizer is not None
    for name in TOKENIZER_FILES:
        if (source.tokenizer / name).is_file():
            shutil.copy2(source.tokenizer / name, folder / name)
    settings = folder / "tokenizer_config.json"
    if settings.is_file():
        # The Nemotron Nano 9B v2 tokenizer's pre-tokenizer regex needs
        # transformers' Mistral fix to split as it was trained.
        values = json.loads(settings.read_text())
        values["fix_mistral_regex"] = True
        settings.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")


def model_card(source: Source, plan: Plan, written: dict[str, int]) -> str:
    """The README.md of a converted checkpoint: its profile and measured sizes."""
    formats = plan.part_formats()
    total = sum(written.values())
    kept = (f"\n{plan.kept} layers the source already stored quantized are kept as they "
            "were (requantizing would only add error).\n" if plan.kept else "")
    rows = "\n".join(f"| {name} | {formats.get(name, 'as stored')} | {size:,d} | "
                     f"{size / 2**30:.3f} |" for name, size in written.items())
    return f"""---
library_name: mlx
tags: [mlx, nemotron_voicechat, speech-to-speech]
---
# Nemotron VoiceChat, `{plan.profile.name}` profile

Converted with `mlx-voicechat convert --profile {plan.profile.name}` from
{LAYOUT_NAMES[source.layout]}. Profile: {plan.profile.description}.
{kept}
Weights as written (bytes measured on write, per part):

| part | format | bytes | GiB |
|---|---|---:|---:|
{rows}
| **total** | | {total:,d} | {total / 2**30:.3f} |

Run it with `mlx-voicechat generate -m PATH --audio question.wav`, or check it
against another conversion with `mlx-voicechat compare A B --audio question.wav`.
"""


def _temporary_folder(out: Path) -> Path:
    folder = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def convert(src: str | Path, out: str | Path, profile: "str | Profile" = "release", *,
            tokenizer: str | None = None, force: bool = False, progress: bool = True,
            max_shard_bytes: int = MAX_SHARD_BYTES) -> Conversion:
    """Convert ``src`` (either layout) into ``out`` under ``profile``.

    ``out`` appears only complete. It may exist only empty or, with ``force``, as
    a checkpoint of this model that is not the source, does not contain it and is
    not inside it (:func:`~..outputs.check_output_folder`); it is replaced only
    once the new one is whole.
    """
    out = Path(out).expanduser().absolute()
    profile = get_profile(profile)
    source = open_source(src, tokenizer)
    try:
        check_output_folder(out, "output", force, sources=[source.path])
    except OutputRefused as error:
        raise ConversionError(str(error)) from None
    plan = make_plan(source, profile, max_shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = _temporary_folder(out)
    bar = _Progress(sum(spec.nbytes for spec in source.tensors.values()), progress)
    try:
        written = _write_weights(source, plan, folder, bar)
        config = dict(source.config)
        config[CONFIG_KEY] = plan.profile.record()
        quantization = plan.quantization
        if quantization is not None:
            config["quantization"] = dict(quantization)
            config["quantization_config"] = dict(quantization)
        (folder / "config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False, allow_nan=False) + "\n")
        _copy_side_files(source, folder)
        (folder / CARD_FILE).write_text(model_card(source, plan, written))
        _replace(folder, out)
    except OSError as error:
        shutil.rmtree(folder, ignore_errors=True)
        if error.errno == errno.ENOSPC:
            raise ConversionError(
                f"no space left on the device writing {out} (the conversion needs "
                f"{plan.total_bytes / 2**30:.2f} GiB); nothing was written") from error
        raise
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        bar.close()
    logger.info("wrote %s (%s profile, %.2f GiB)", out, profile.name,
                sum(written.values()) / 2**30)
    return Conversion(out, plan, written)


def _replace(folder: Path, out: Path) -> None:
    """``folder`` becomes ``out``; an existing ``out`` (``--force``) goes only after."""
    if not out.exists():
        folder.rename(out)
        return
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
        folder.rename(out)
        return
    old = out.parent / f".{out.name}.replaced-{os.getpid()}"
    out.rename(old)
    folder.rename(out)
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()
