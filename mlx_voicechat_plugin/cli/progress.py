"""Progress on the work a user waits for, as mlx-lm and huggingface_hub show it.

tqdm bars on standard error, only when it is a terminal and the command was
not given ``--quiet``: a pipe, a log file or a test sees none of it.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator


def add_quiet(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress bars (they show only on a terminal anyway)."""
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bars (shown only when standard error is a terminal)")


def shown(args: argparse.Namespace) -> bool:
    """Whether progress is shown: a terminal on standard error, and no ``--quiet``."""
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


@contextmanager
def step(args: argparse.Namespace, what: str) -> Iterator[None]:
    """One step of unknown length (loading, warming up): a line when it starts, its
    time when it ends."""
    if not shown(args):
        yield
        return
    print(f"{what} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    yield
    print(f"{what}: done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


@contextmanager
def bar(args: argparse.Namespace, what: str, unit: str) -> Iterator[Callable[[int, int], None]]:
    """A bar over counted work; yields ``update(done, total)``."""
    if not shown(args):
        yield lambda done, total: None
        return
    from tqdm import tqdm

    progress: Any = None

    def update(done: int, total: int) -> None:
        nonlocal progress
        if progress is None:
            progress = tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False,
                            dynamic_ncols=True)
        progress.update(done - progress.n)

    try:
        yield update
    finally:
        if progress is not None:
            progress.close()
