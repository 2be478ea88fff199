"""Argument handling shared by the plugin's commands."""

from __future__ import annotations

import argparse
import sys
import logging
from typing import Callable, Sequence

from ..runtime.device_settings import MAX_GRAPH_COMMIT_OPS, check_graph_commit_ops


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


def add_graph_commit_ops(parser: argparse.ArgumentParser) -> None:
    """``--graph-commit-ops N``: how many GPU operations MLX commits at once."""
    parser.add_argument("--graph-commit-ops", type=int, default=None, metavar="N",
                        help="commit GPU work every N operations (MLX_MAX_OPS_PER_BUFFER, set "
                             "before the model loads; 1 to "
                             f"{MAX_GRAPH_COMMIT_OPS}; 0 or absent: MLX's default, e.g. 100 "
                             "on Hopper; the CPU ignores it; docs/gpu.md)")


def add_memory_budget(parser: argparse.ArgumentParser) -> None:
    """``--memory-budget GIB``: what the model and its sessions may use (docs/memory.md)."""
    parser.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                        help="GiB the model and its sessions may use (default: the device's: "
                             "Metal's recommended working set, a CUDA device's memory, or RAM); "
                             "float32 weight copies are held only where they fit, and a "
                             "checkpoint that cannot fit is refused naming a profile that does")


def check_device_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 with the flag and its limit when ``--graph-commit-ops`` or
    ``--memory-budget`` is out of range."""
    try:
        check_graph_commit_ops(args.graph_commit_ops)
    except ValueError as error:
        parser.error(str(error))
    check_memory_budget(parser, args)


def check_memory_budget(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 naming the flag when ``--memory-budget`` is not a positive finite GiB."""
    budget = getattr(args, "memory_budget", None)
    if budget is not None and not 0 < budget < float("inf"):
        parser.error(f"--memory-budget must be a positive number of GiB, got {budget:g}")


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
