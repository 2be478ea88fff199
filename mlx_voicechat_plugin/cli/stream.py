"""``generate --stream``: the input plus extra silence through the online session."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import mlx.core as mx
import numpy as np

from ..runtime.audio import load_waveform, write_wav
from ..runtime.events import AssistantTextDelta, Audio, FunctionDelta
from . import progress

COLD_FRAMES = 5


def run_stream(session: Any, args: argparse.Namespace, started: float, loaded: float) -> int:
    config = session.config
    rate, frame = config.input_sample_rate, config.frame_samples
    audio = np.array(load_waveform(args.audio, rate))
    audio = np.concatenate([audio, np.zeros(round(args.extra_decoding_seconds * rate), np.float32)])
    stream = session.create_streaming_session(
        system_prompt=args.system_prompt, seed=args.seed,
        max_streaming_seconds=args.max_streaming_seconds,
        use_language_cache=not args.no_language_cache, profile=args.profile,
        context_seconds=args.context_seconds, top_p=args.top_p,
    )
    total = -(-len(audio) // frame)
    samples: list[np.ndarray] = []
    function_text = ""

    def handle(events: list[Any]) -> None:
        nonlocal function_text
        for event in events:
            if isinstance(event, AssistantTextDelta):
                print(event.delta, end="", flush=True)
            elif isinstance(event, FunctionDelta):
                function_text = event.text
            elif isinstance(event, Audio):
                samples.append(event.samples)

    begun = time.perf_counter()
    with progress.bar(args, "streaming", "frame") as update:
        for index, start in enumerate(range(0, len(audio), frame)):
            handle(stream.push_audio(audio[start : start + frame]))
            update(index + 1, total)
    handle(stream.flush())
    elapsed = time.perf_counter() - begun
    print()
    if stream.transcript:
        print(f"[user] {stream.transcript}")
    if function_text.strip():
        print(f"[function] {function_text}")
    if args.output_audio:
        write_wav(args.output_audio, np.concatenate(samples), config.output_sample_rate, scale=32768.0)
        print(f"wrote {args.output_audio}", file=sys.stderr)
    if args.profile:
        print(json.dumps(stream.profile().summary(drop_first=COLD_FRAMES), indent=2))
    if args.verbose:
        frames = stream.frame_index
        print(f"load {loaded - started:.2f} s, stream {elapsed:.2f} s, {frames} frames, "
              f"{frames / max(elapsed, 1e-9):.1f} frames/s, "
              f"peak memory {mx.get_peak_memory() / 2**30:.3f} GB", file=sys.stderr)
    return 0
