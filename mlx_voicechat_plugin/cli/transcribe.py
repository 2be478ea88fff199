"""``mlx-voicechat transcribe``: a file's transcript from the checkpoint's RNNT branch.

The same entry point serves ``python -m mlx_audio.stt.generate`` when it is
given a VoiceChat checkpoint (see :mod:`mlx_voicechat_plugin.hosts.pickup`),
in that command's style: ``--audio``, ``--output-path`` (writes
``PATH.txt`` / ``PATH.json``; ``-`` is standard output; without it the
transcript is printed), ``--format txt|json``, ``--max-tokens``,
``--language``, ``--stream`` and ``--verbose``. Only perception and the RNNT
run: no LLM, TTS or codec work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from . import progress
from .common import (
    add_memory_budget,
    check_audio_file,
    check_memory_budget,
    check_model,
    check_output_file,
    parse_args,
    run_main,
)
from .progress import add_quiet

if TYPE_CHECKING:
    from ..hosts.conventions import HostServer

FORMATS = ("txt", "json")


def build_parser(prog: str = "mlx-voicechat transcribe") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Transcribe speech with Nemotron VoiceChat's RNNT branch.")
    parser.add_argument("-m", "--model", required=True, help="checkpoint directory or hub id")
    parser.add_argument("--audio", required=True, help="input speech (WAV/FLAC/MP3, any rate)")
    parser.add_argument("--output-path",
                        help="write the transcript to OUTPUT_PATH.txt / .json ('-': standard "
                             "output); without it the transcript is printed")
    parser.add_argument("--format", default="txt",
                        help="output format: txt or json (srt/vtt need timestamps, which the "
                             "RNNT transcript does not carry)")
    parser.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int,
                        help="most output tokens (default: no limit)")
    parser.add_argument("--language", default="auto",
                        help="'auto' or the checkpoint's language")
    parser.add_argument("--stream", action="store_true",
                        help="print the transcript as it is decoded")
    parser.add_argument("--verbose", action="store_true",
                        help="timings and peak memory; an error's traceback")
    add_quiet(parser)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="fuse kernels with mx.compile (default: on GPUs; off on the CPU)")
    add_memory_budget(parser)
    return parser


def parse(argv: Sequence[str] | None, prog: str, tolerate_unknown: bool) -> argparse.Namespace:
    parser = build_parser(prog)
    args = parse_args(parser, argv, tolerate_unknown)
    check_memory_budget(parser, args)
    args.format = args.format.lower()
    if args.format not in FORMATS:
        parser.error(f"--format must be txt or json for this model, got {args.format!r} "
                     "(srt/vtt need timestamps, which the RNNT transcript does not carry)")
    if args.max_tokens is not None and args.max_tokens < 1:
        parser.error(f"--max-tokens must be a positive integer, got {args.max_tokens}")
    return args


def _write(text: str, output_path: str | None, fmt: str) -> None:
    if output_path is None or output_path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(f"{output_path}.{fmt}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    check_model(args.model)
    check_audio_file(args.audio)
    if args.output_path not in (None, "-"):
        check_output_file(f"{args.output_path}.{args.format}", "--output-path")

    import mlx.core as mx

    from ..checkpoint import read_config
    from ..loader import load
    from ..runtime import compile_policy
    from ..runtime.transcribe import Transcriber

    started = time.perf_counter()
    with progress.step(args, f"loading {args.model}"):
        model, processor = load(args.model, memory_budget=args.memory_budget)
    compile_policy.apply(args.compile, long_running=False,
                         key=compile_policy.model_key(read_config(model.model_path)))
    transcriber = Transcriber(model.create_session(processor))
    if args.language.lower() not in ("auto", transcriber.language):
        raise ValueError(f"--language must be 'auto' or {transcriber.language!r} (the "
                         f"checkpoint's language), got {args.language!r}")
    loaded = time.perf_counter()
    live = args.stream and args.format == "txt" and args.output_path is None
    with progress.bar(args, "transcribing", "frame") as update:
        steps = transcriber.steps(args.audio, max_new_tokens=args.max_tokens,
                                  on_progress=None if live else update)
        while True:
            try:
                deltas = next(steps)
            except StopIteration as done:
                result = done.value
                break
            if live:
                for delta in deltas:
                    sys.stdout.write(delta.delta)
                    sys.stdout.flush()
    finished = time.perf_counter()
    if live:
        sys.stdout.write("\n")
    elif args.format == "json":
        payload = {"text": result.text, "segments": [], "language": transcriber.language,
                   "duration": round(result.duration, 3)}
        _write(json.dumps(payload, ensure_ascii=False, indent=2) + "\n", args.output_path, "json")
    else:
        _write(result.text + "\n", args.output_path, "txt")
    if args.verbose:
        seconds = finished - loaded
        print(f"load {loaded - started:.2f} s, transcribe {seconds:.2f} s for "
              f"{result.duration:.2f} s of audio ({result.duration / max(seconds, 1e-9):.1f}x "
              f"real time), {len(result.tokens)} tokens, peak memory "
              f"{mx.get_peak_memory() / 2**30:.3f} GB", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "mlx-voicechat transcribe",
         tolerate_unknown: bool = False, host: "HostServer | None" = None) -> int:
    """The command (``host``: the registry's uniform argument; transcribe needs nothing of it)."""
    return run_main(parse, run, argv, prog, tolerate_unknown)
