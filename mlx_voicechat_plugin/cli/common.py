"""Argument handling shared by the plugin's commands."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


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
