"""Argument handling shared by the plugin's commands."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from ..runtime.device_settings import MAX_GRAPH_COMMIT_OPS, check_graph_commit_ops
from ..runtime.options import check_temperature, check_top_p


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


def add_sampling(parser: Any,
                 whose: str = "") -> None:
    """mlx-lm's ``--temperature`` / ``--top-p``, with the reference's defaults."""
    parser.add_argument("--temperature", "--temp", type=float, default=0.0,
                        help=f"text sampling temperature{whose}; the reference decodes "
                             "greedily, so 0 (the default) is the only value this model takes")
    parser.add_argument("--top-p", type=float, default=None,
                        help=f"nucleus of the speech head's mixture components{whose}, in "
                             "(0, 1] (default: the checkpoint's tts_config.top_p, 0.95 in "
                             "the release, as the reference)")


def check_sampling(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 naming the flag when ``--temperature`` / ``--top-p`` ask for what this
    model cannot do (the session options' own checks)."""
    try:
        check_temperature(args.temperature, "--temperature")
        check_top_p(args.top_p, "--top-p")
    except ValueError as error:
        parser.error(str(error))


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


# Exit codes, the same for every command (docs/usage.md, "Exit codes").
EXIT_OK = 0
EXIT_FAILURE = 1  # the work could not be done: a port in use, a full disk, no memory
EXIT_USAGE = 2  # what was asked for is wrong: a flag, a value, a path or file it names


def user_error_code(error: BaseException) -> int | None:
    """The exit code of a user's error, one line without a traceback; ``None``: a bug,
    whose traceback is shown."""
    from ..budget import BudgetExceeded

    if isinstance(error, BudgetExceeded):
        return EXIT_FAILURE
    if isinstance(error, UsageError):
        return EXIT_USAGE
    if isinstance(error, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return EXIT_USAGE
    if isinstance(error, OSError):  # permissions, a full disk, a port in use
        return EXIT_FAILURE
    if isinstance(error, ValueError) and _raised_here(error):
        return EXIT_USAGE  # this package's own checks of what it was given
    return None


def _raised_here(error: BaseException) -> bool:
    """Whether ``error`` was raised by this package's code (its own message), not
    deep inside a library (a shape error: a bug)."""
    tb = error.__traceback__
    if tb is None:
        return True
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)


_PACKAGE = Path(__file__).resolve().parents[1]


def report(error: BaseException, verbose: bool = False) -> int:
    """Print a user's error as one line (``verbose``: its traceback first); its exit code.
    A bug is raised again, traceback and all."""
    code = user_error_code(error)
    if code is None:
        raise error
    if verbose:
        traceback.print_exception(error)
    message = str(error) or type(error).__name__
    if isinstance(error, OSError) and error.strerror and error.filename:
        message = f"{error.filename}: {error.strerror}"
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return code


def run_main(parse: Callable[..., argparse.Namespace], run: Callable[[argparse.Namespace], int],
             argv: Sequence[str] | None, prog: str, tolerate_unknown: bool) -> int:
    """A command's ``main``: parse, run; a user's error is one line and its exit code
    (:func:`report`), a bug its traceback; Ctrl-C is exit 130, one line."""
    logging.basicConfig(level=logging.WARNING)
    args = parse(argv, prog, tolerate_unknown)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        return report(error, getattr(args, "verbose", False))


# The first bytes of the audio files the hosts' reader takes.
_AUDIO_MAGIC = ((b"RIFF", "WAV"), (b"RF64", "WAV"), (b"fLaC", "FLAC"), (b"OggS", "Ogg"),
                (b"ID3", "MP3"), (b"\xff\xfb", "MP3"), (b"\xff\xf3", "MP3"),
                (b"\xff\xf2", "MP3"), (b"FORM", "AIFF"))


def audio_file_problem(path: str) -> str | None:
    """What keeps ``path`` from being read as audio (missing, a folder, not audio, a WAV
    with no samples), or ``None``; read from its first bytes, before any model loads."""
    file = Path(path).expanduser()
    if not file.exists():
        return "file not found"
    if file.is_dir():
        return "is a folder, not an audio file"
    try:
        with open(file, "rb") as handle:
            head = handle.read(12)
            kind = next((name for magic, name in _AUDIO_MAGIC if head.startswith(magic)), None)
            if kind is None:
                return ("is not an audio file (WAV, FLAC, MP3 or Ogg)"
                        + (": it is empty" if not head else ""))
            if kind == "WAV" and head[8:12] == b"WAVE" and _wav_data_bytes(handle) == 0:
                return "is a WAV file with no samples"
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    return None


def _wav_data_bytes(handle) -> int | None:
    """The size of a RIFF WAVE file's ``data`` chunk (after the 12-byte header), or None."""
    while True:
        chunk = handle.read(8)
        if len(chunk) < 8:
            return 0 if not chunk else None
        size = int.from_bytes(chunk[4:8], "little")
        if chunk[:4] == b"data":
            return min(size, max(0, Path(handle.name).stat().st_size - handle.tell()))
        handle.seek(size + (size & 1), 1)


class UsageError(ValueError):
    """What a command line names cannot be used (exit 2): checked before a model loads."""


def check_audio_file(path: str | None, flag: str = "--audio") -> None:
    """:class:`UsageError` naming ``flag`` when ``path`` is not audio a command can read."""
    problem = None if path is None else audio_file_problem(path)
    if problem is not None:
        raise UsageError(f"{flag} {path}: {problem}")


def check_model(name: str, flag: str = "--model") -> None:
    """:class:`UsageError` naming ``flag`` when ``name`` is a local checkpoint that is
    missing or not whole (:func:`~..checkpoint.check_checkpoint`); a hub id is checked
    when it loads."""
    from ..checkpoint import CheckpointError, check_checkpoint, is_hub_id, resolve_path

    try:
        if Path(name).expanduser().exists() or not is_hub_id(name):
            check_checkpoint(resolve_path(name))
    except CheckpointError as error:
        raise UsageError(f"{flag}: {error}") from None


def check_output_file(path: str | None, flag: str) -> None:
    """:class:`UsageError` naming ``flag`` when writing ``path`` would replace a folder or
    cannot be done (:func:`~..outputs.check_output_file`)."""
    from ..outputs import OutputRefused, check_output_file as check

    if path is not None:
        try:
            check(path, flag)
        except OutputRefused as error:
            raise UsageError(str(error)) from None
