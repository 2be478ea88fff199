"""Argument handling shared by the plugin's commands."""

from __future__ import annotations

import argparse
import sys
import logging
from typing import Callable, Sequence


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, tolerate_unknown: bool
) -> argparse.Namespace:
    """Parse ``argv``; when run for a host command, ignore (and name) its other flags."""
    if not tolerate_unknown:
        return parser.parse_args(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"note: ignoring options this model does not use: {' '.join(unknown)}",
              file=sys.stderr)
    return args


def run_main(parse: Callable[..., argparse.Namespace], run: Callable[[argparse.Namespace], int],
             argv: Sequence[str] | None, prog: str, tolerate_unknown: bool) -> int:
    """A command's ``main``: parse, run; bad input (a value or a missing file) is exit 2."""
    logging.basicConfig(level=logging.WARNING)
    args = parse(argv, prog, tolerate_unknown)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
