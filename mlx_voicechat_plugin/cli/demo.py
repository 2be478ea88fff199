"""``make demo``: build the embedded demo checkpoint and answer a synthetic question.

Writes ``<out>/checkpoint`` (the tiny random fixture), ``<out>/question.wav``
and ``<out>/response.wav``, and prints the transcript, the answer and frames/s.
The checkpoint is random, so the words are too; the pipeline is the real one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..outputs import OutputRefused, check_output_file, check_output_folder
from .common import UsageError, add_memory_budget, check_memory_budget, parse_args, run_main
from .progress import add_quiet

if TYPE_CHECKING:
    from ..hosts.conventions import HostServer


def parse(argv: Sequence[str] | None, prog: str, tolerate_unknown: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="build/demo", help="output directory")
    parser.add_argument("--size", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--seconds", type=float, default=2.0, help="question length")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="fuse kernels with mx.compile (see mlx-voicechat generate)")
    add_memory_budget(parser)
    add_quiet(parser)
    args = parse_args(parser, argv, tolerate_unknown)
    check_memory_budget(parser, args)
    if not args.seconds > 0:
        parser.error(f"--seconds must be > 0, got {args.seconds:g}")
    return args


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    # The demo's own files only: its checkpoint (replaced, never a folder of anything
    # else) and its two WAVs; whatever else --out holds stays.
    try:
        check_output_folder(out / "checkpoint", "--out", force=True)
        for name in ("question.wav", "response.wav"):
            check_output_file(out / name, "--out")
    except OutputRefused as error:
        raise UsageError(str(error)) from None

    from ..testing.fixtures import make_checkpoint, make_question_wav
    from .generate import main as generate_main

    print("the checkpoint's weights are random: the answer's words are gibberish by "
          "design; the pipeline is the real one", flush=True)
    print(f"building the {args.size} demo checkpoint in {out / 'checkpoint'} ...", flush=True)
    checkpoint = make_checkpoint(out / "checkpoint", args.size)
    question = make_question_wav(out / "question.wav", seconds=args.seconds)
    response = out / "response.wav"
    started = time.perf_counter()
    flags = [] if args.compile is None else ["--compile" if args.compile else "--no-compile"]
    if args.memory_budget is not None:
        flags += ["--memory-budget", str(args.memory_budget)]
    if args.quiet:
        flags.append("--quiet")
    code = generate_main(
        ["--model", str(checkpoint), "--audio", str(question),
         "--output-audio", str(response), "--verbose", *flags]
    )
    print(f"demo finished in {time.perf_counter() - started:.1f} s -> {response}")
    return code


def main(argv: Sequence[str] | None = None, prog: str = "mlx-voicechat demo",
         tolerate_unknown: bool = False, host: "HostServer | None" = None) -> int:
    """The command (``host``: the registry's uniform argument; demo needs nothing of it)."""
    return run_main(parse, run, argv, prog, tolerate_unknown)


if __name__ == "__main__":
    sys.exit(main())
