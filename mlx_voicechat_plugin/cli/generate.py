"""``mlx-voicechat generate``: one offline voice-chat turn from the command line.

The same entry point serves ``python -m mlx_vlm.generate`` and
``python -m mlx_audio.sts.generate`` when they are given a VoiceChat
checkpoint (see :mod:`mlx_voicechat_plugin.hosts.pickup`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..runtime.options import DEFAULT_CONTEXT_SECONDS, DEFAULT_EXTRA_DECODING_SECONDS
from . import progress
from .common import (
    add_graph_commit_ops,
    add_memory_budget,
    add_sampling,
    check_audio_file,
    check_device_options,
    check_model,
    check_output_file,
    check_sampling,
    parse_args,
    run_main,
    UsageError,
)
from .progress import add_quiet

if TYPE_CHECKING:
    from ..hosts.conventions import HostServer

FRAME_SECONDS = 0.08  # the model emits one text token per 80 ms frame
OFFLINE_HINT = "mlx-voicechat generate --model CKPT --audio question.wav --output-audio answer.wav"


def build_parser(prog: str = "mlx-voicechat generate") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Answer a spoken question with Nemotron VoiceChat."
    )
    parser.add_argument("-m", "--model", required=True, help="checkpoint directory or hub id")
    parser.add_argument("--audio", help="input speech (WAV/FLAC/MP3, any rate)")
    parser.add_argument(
        "--output-audio",
        "--output-path",
        "--output",
        dest="output_audio",
        help="write the spoken answer here (22.05 kHz mono PCM16 WAV; --output is "
             "mlx-vlm's name, --output-path mlx-audio's)",
    )
    parser.add_argument("--system-prompt", "--system", dest="system_prompt",
                        help="the system prompt (default: the checkpoint's)")
    parser.add_argument("-p", "--prompt", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--extra-decoding-seconds", type=float, default=None,
                        help="seconds decoded after the question's audio ends "
                             f"(default: {DEFAULT_EXTRA_DECODING_SECONDS})")
    parser.add_argument("--seed", type=int, default=0)
    add_sampling(parser)
    parser.add_argument(
        "-n", "--max-tokens", "--max-new-tokens", dest="max_tokens", type=int,
        help="tokens decoded after the question's audio ends, one per 80 ms frame "
             "(mlx-lm's name for the answer's length; instead of --extra-decoding-seconds)",
    )
    parser.add_argument("--image", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--video", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--no-language-cache", action="store_true",
                        help="recompute the LLM history every frame (diagnostics)")
    parser.add_argument("--context-seconds", type=float, default=DEFAULT_CONTEXT_SECONDS,
                        help="seconds of conversation the attention layers keep after the "
                             "prompt (constant memory past it; 0: unbounded, the reference; "
                             "default: %(default)s)")
    parser.add_argument("--verbose", action="store_true",
                        help="timings and peak memory; an error's traceback")
    add_quiet(parser)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="fuse kernels with mx.compile (default: on GPUs; off on the CPU, "
                             "where a cold kernel cache costs a minute of compiling)")
    add_graph_commit_ops(parser)
    add_memory_budget(parser)
    tools = parser.add_argument_group("tool calling")
    tools.add_argument("--tools-json", help="JSON file: a list of tools (name, description, "
                       "parameters JSON schema, optional ack_messages)")
    tools.add_argument("--api-response-json", help="JSON file: the tool result(s) to inject; "
                       "runs the two-pass offline flow (find the call, rerun with the result)")
    stream = parser.add_argument_group("streaming")
    stream.add_argument("--stream", action="store_true",
                        help="drive the online session in 80 ms frames, printing text as it comes")
    stream.add_argument("--profile", action="store_true",
                        help="with --stream: print the stage-timing summary (5 cold frames dropped)")
    stream.add_argument("--max-streaming-seconds", type=float)
    return parser


def parse(argv: Sequence[str] | None, prog: str, tolerate_unknown: bool) -> argparse.Namespace:
    parser = build_parser(prog)
    args = parse_args(parser, argv, tolerate_unknown)
    check_device_options(parser, args)
    if args.prompt:
        parser.error("--prompt: Nemotron VoiceChat answers speech, not a text prompt; pass "
                     "the question as --audio (and a system prompt as --system)")
    check_sampling(parser, args)
    if args.image or args.video:
        parser.error("Nemotron VoiceChat takes speech only: --image/--video are not supported")
    if not args.audio:
        parser.error(
            "Nemotron VoiceChat is a speech-to-speech model and has no interactive "
            f"text mode; pass --audio, e.g. {OFFLINE_HINT}"
        )
    if args.api_response_json and not args.tools_json:
        parser.error("--api-response-json needs --tools-json")
    if args.stream and args.tools_json:
        parser.error("--tools-json runs the offline flow; use the server for live tool calls")
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            parser.error(f"--max-tokens must be a positive integer, got {args.max_tokens}")
        if args.extra_decoding_seconds is not None:
            parser.error("--max-tokens and --extra-decoding-seconds both set the answer's "
                         "length; give one")
        args.extra_decoding_seconds = args.max_tokens * FRAME_SECONDS
    elif args.extra_decoding_seconds is None:
        args.extra_decoding_seconds = DEFAULT_EXTRA_DECODING_SECONDS
    return args


def check_paths(args: argparse.Namespace) -> None:
    """What the command line names, before the model loads (:class:`UsageError`)."""
    check_model(args.model)
    check_audio_file(args.audio)
    check_output_file(args.output_audio, "--output-audio")
    for flag, path in (("--tools-json", args.tools_json),
                       ("--api-response-json", args.api_response_json)):
        if path is not None and not Path(path).expanduser().is_file():
            raise UsageError(f"{flag} {path}: no such file")


def run(args: argparse.Namespace) -> int:
    check_paths(args)  # before the networks' modules are imported: a mistake is told at once

    import mlx.core as mx

    from ..checkpoint import read_config
    from ..loader import load
    from ..runtime import compile_policy
    from ..runtime.audio import write_wav
    from ..runtime.device_settings import apply_graph_commit_ops

    apply_graph_commit_ops(args.graph_commit_ops)  # read once, at the GPU's first work
    started = time.perf_counter()
    with progress.step(args, f"loading {args.model}"):
        model, processor = load(args.model, memory_budget=args.memory_budget)
    key = compile_policy.model_key(read_config(model.model_path))
    compile_policy.apply(args.compile, long_running=False, key=key)
    loaded = time.perf_counter()
    session = model.create_session(processor)
    if args.stream:
        from .stream import run_stream

        code = run_stream(session, args, started, loaded)
        compile_policy.mark_warm(key)
        return code
    if args.profile or args.max_streaming_seconds is not None:
        print("note: --profile/--max-streaming-seconds apply with --stream only", file=sys.stderr)
    tools, responses = _read_tool_files(args)
    turn = dict(
        system_prompt=args.system_prompt,
        extra_decoding_seconds=args.extra_decoding_seconds,
        seed=args.seed,
        use_language_cache=not args.no_language_cache,
        context_seconds=args.context_seconds,
        top_p=args.top_p,
        tools=tools,
    )
    with progress.bar(args, "answering", "frame") as update:
        result = session.generate(args.audio, on_progress=update, **turn)
    compile_policy.mark_warm(key)  # a compiled run finished: its kernels are cached
    if tools is not None:
        for call in result.tool_calls:
            print(f"[tool_call] {call.name}({call.arguments}) id={call.call_id} frame={call.frame_index}")
        for error in result.tool_errors:
            print(f"[tool_call_invalid] {error.reason}: {error.raw}", file=sys.stderr)
    if responses is not None:
        if not result.tool_calls:
            print("note: the first pass made no tool call; --api-response-json is unused",
                  file=sys.stderr)
        else:
            with progress.bar(args, "answering with the tool result", "frame") as update:
                result = session.generate(args.audio, tool_response=responses,
                                          on_progress=update, **turn)
            print("[second pass: tool result injected]")
    finished = time.perf_counter()
    if result.user_transcript is not None:
        print(f"[user] {result.user_transcript}")
    print(result.text)
    if result.function_text.strip():
        print(f"[function] {result.function_text}")
    if args.output_audio:
        write_wav(args.output_audio, result.audio, result.sample_rate, scale=32768.0)
        print(f"wrote {args.output_audio} ({result.audio.shape[0] / result.sample_rate:.2f} s)",
              file=sys.stderr)
    if args.verbose:
        frames = len(result.text_tokens)
        seconds = finished - loaded
        print(
            f"load {loaded - started:.2f} s, generate {seconds:.2f} s, {frames} frames, "
            f"{frames / max(seconds, 1e-9):.1f} frames/s, "
            f"peak memory {mx.get_peak_memory() / 2**30:.3f} GB",
            file=sys.stderr,
        )
    return 0


def _read_tool_files(args: argparse.Namespace) -> tuple[list[dict] | None, list[str] | None]:
    """``--tools-json`` as a list of tool dicts; ``--api-response-json`` as result strings."""
    import json
    from pathlib import Path

    tools = responses = None
    if args.tools_json:
        tools = json.loads(Path(args.tools_json).read_text())
        if isinstance(tools, dict):
            tools = tools.get("tools", [tools])
        if not isinstance(tools, list):
            raise ValueError(f"--tools-json {args.tools_json}: expected a list of tools")
    if args.api_response_json:
        payload = json.loads(Path(args.api_response_json).read_text())
        items = payload if isinstance(payload, list) else [payload]
        responses = [item if isinstance(item, str) else json.dumps(item) for item in items]
    return tools, responses


def main(argv: Sequence[str] | None = None, prog: str = "mlx-voicechat generate",
         tolerate_unknown: bool = False, host: "HostServer | None" = None) -> int:
    """The command (``host``: the registry's uniform argument; generate needs nothing of it)."""
    return run_main(parse, run, argv, prog, tolerate_unknown)
