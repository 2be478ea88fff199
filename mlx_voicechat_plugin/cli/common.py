"""Argument handling shared by the plugin's commands."""

from __future__ import annotations

import argparse
import sys
import logging
from typing import Callable, Sequence


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, tolerate_unknown: bool,
    report: bool = True,
) -> argparse.Namespace:
    """Parse ``argv``; when run for a host command, ignore its other flags.

    The ignored ones are ``args.ignored_options``, one entry per flag with its
    values; ``report`` prints a line for each (a command that logs them
    itself passes ``False``).
    """
    if not tolerate_unknown:
        args = parser.parse_args(argv)
        args.ignored_options = []
        return args
    args, unknown = parser.parse_known_args(argv)
    args.ignored_options = group_options(unknown)
    if report:
        for option in args.ignored_options:
            print(f"note: ignoring options this model does not use: {option}", file=sys.stderr)
    return args


def group_options(tokens: Sequence[str]) -> list[str]:
    """``["--a", "1", "--b"]`` -> ``["--a 1", "--b"]``: each flag with the values after it."""
    options: list[str] = []
    for token in tokens:
        if token.startswith("-") or not options:
            options.append(token)
        else:
            options[-1] += f" {token}"
    return options


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
