"""``mlx-voicechat convert SRC OUT --profile NAME``: a checkpoint in a precision profile.

SRC is NVIDIA's original release (its NeMo-style config, safetensors shards,
``rnnt_tokenizer/``; the LLM's config and tokenizer from ``--tokenizer``, by
default the Nemotron Nano 9B v2 repository) or an MLX conversion (bf16 or
quantized: layers already quantized are kept). ``--dry-run`` prints each part
with its format and bytes and writes nothing (SRC may then be a folder with
a config.json alone: the parts are sized from its shapes). OUT appears only
complete; ``--force`` replaces an existing OUT only when it is a checkpoint of
this model, never the source, a folder holding it or one inside it
(:mod:`..outputs`).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Sequence

from .common import UsageError, parse_args, run_main

if TYPE_CHECKING:
    from ..hosts.conventions import HostServer


def build_parser(prog: str = "mlx-voicechat convert") -> argparse.ArgumentParser:
    from ..profiles import PROFILES

    profiles = "; ".join(f"{p.name}: {p.description}" for p in PROFILES.values())
    parser = argparse.ArgumentParser(
        prog=prog, description="Convert a Nemotron VoiceChat checkpoint to a precision profile.",
        epilog=f"profiles: {profiles}")
    parser.add_argument("src", help="NVIDIA's release folder or an MLX conversion")
    parser.add_argument("out", help="output folder (written only when complete)")
    parser.add_argument("--profile", default="release",
                        help=f"one of {', '.join(PROFILES)} (default: release)")
    parser.add_argument("--tokenizer", default=None,
                        help="the LLM's config and tokenizer for a release source: a folder or "
                             "hub id (default: nvidia/NVIDIA-Nemotron-Nano-9B-v2)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each part's format and bytes; write nothing")
    parser.add_argument("--force", action="store_true",
                        help="replace OUT if it is a nemotron_voicechat checkpoint (never "
                             "a folder holding anything else, the source or a folder around it)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar")
    return parser


def parse(argv: Sequence[str] | None, prog: str, tolerate_unknown: bool) -> argparse.Namespace:
    return parse_args(build_parser(prog), argv, tolerate_unknown)


def run(args: argparse.Namespace) -> int:
    from ..outputs import OutputRefused, check_output_folder
    from ..profiles import get_profile

    profile = get_profile(args.profile)
    if not args.dry_run:  # before the source is read or fetched
        try:
            check_output_folder(args.out, "OUT", args.force, sources=[args.src])
        except OutputRefused as error:
            raise UsageError(str(error)) from None
    # The networks' configs, imported once the command line is known to be sound.
    from ..conversion.convert import convert, describe, plan_conversion

    if args.dry_run:
        source, plan = plan_conversion(args.src, profile, tokenizer=args.tokenizer)
        print(describe(source, plan))
        return 0
    done = convert(args.src, args.out, profile, tokenizer=args.tokenizer, force=args.force,
                   progress=args.progress)
    print(f"wrote {done.out} ({profile.name}: {done.total / 2**30:.3f} GiB of weights)",
          file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "mlx-voicechat convert",
         tolerate_unknown: bool = False, host: "HostServer | None" = None) -> int:
    """The command (``host``: the registry's uniform argument; convert needs nothing of it)."""
    return run_main(parse, run, argv, prog, tolerate_unknown)
