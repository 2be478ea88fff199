"""Benchmarks: ratios measured on this machine (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
from pathlib import Path


def check_output(parser: argparse.ArgumentParser, path: str | Path | None, flag: str) -> None:
    """Exit 2 naming ``flag`` when writing the file ``path`` would replace a folder or
    cannot be done: the commands' rule (:mod:`mlx_voicechat_plugin.outputs`), checked
    before the benchmark runs."""
    from mlx_voicechat_plugin.outputs import OutputRefused, check_output_file

    if path is not None:
        try:
            check_output_file(path, flag)
        except OutputRefused as error:
            parser.error(str(error))
