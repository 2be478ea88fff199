"""``mlx-voicechat compare A B --audio q.wav``: one question through two checkpoints.

A and B are two conversions of one model (say ``release`` and ``lean``), or one
checkpoint under two ``--memory-budget`` values. Both answer the same
question with the same seed; the report gives each side's user transcript and
answer text, how far their ids agree (text, function channel, audio codes:
matches and the first frame where they part), the answer audio transcribed
back through A's RNNT (a quantized TTS that still speaks the answer
transcribes alike), and the signal-to-noise ratio of B's float stages against
A's: the log-mel, encoder and projection to the LLM on the question; the
LLM's text logits, the EAR-TTS backbone's hidden states and the MoG head's
mixture logits teacher-forced on the same tokens (B's answer), so each stage
measures the error up to it while the sampled ids may have parted; and the
waveform. Random fixture weights say nothing about a profile's quality; a
real checkpoint does.

Only one model is in memory at a time: B runs first, then A, which also
transcribes both answers.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import numpy as np

from ..runtime.options import DEFAULT_EXTRA_DECODING_SECONDS
from . import progress
from .common import (add_sampling, check_audio_file, check_model, check_sampling, parse_args,
                     run_main)
from .progress import add_quiet

if TYPE_CHECKING:
    from ..hosts.conventions import HostServer

# Float stages: on the same audio (mel, encoder, projection), teacher-forced on
# the same tokens (B's answer: the LLM's text logits, the EAR-TTS backbone's
# hidden states and the MoG head's mixture logits), and the answer's waveform.
FLOAT_STAGES = ("mel", "encoder", "projection", "llm_logits", "tts_backbone", "mog_logits",
                "waveform")
ID_STAGES = ("text_ids", "function_ids", "codes")


@dataclass
class Side:
    """One checkpoint's run of the question."""

    label: str
    path: str
    memory_budget: float | None
    user_transcript: str
    answer: str
    answer_heard: str = ""  # the answer audio, transcribed through A's RNNT
    arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)


@dataclass
class FloatStage:
    stage: str
    snr_db: float  # B against A; inf where identical
    max_abs: float
    max_rel: float  # max_abs over A's largest magnitude


@dataclass
class IdStage:
    stage: str
    equal: int
    total: int
    first_divergence: int | None  # the first frame where they differ (None: never)


@dataclass
class Report:
    a: Side
    b: Side
    floats: list[FloatStage]
    ids: list[IdStage]

    def stage(self, name: str) -> FloatStage | IdStage:
        return next(s for s in [*self.floats, *self.ids] if s.stage == name)

    def to_dict(self) -> dict[str, Any]:
        def side(s: Side) -> dict[str, Any]:
            return {k: v for k, v in asdict(s).items() if k != "arrays"}

        def finite(value: float) -> float | None:
            return value if math.isfinite(value) else None  # JSON has no infinity

        return {"a": side(self.a), "b": side(self.b),
                "float_stages": [{**asdict(s), "snr_db": finite(s.snr_db)} for s in self.floats],
                "id_stages": [asdict(s) for s in self.ids]}

    def text(self) -> str:
        lines = []
        for s in (self.a, self.b):
            budget = "" if s.memory_budget is None else f", budget {s.memory_budget:g} GiB"
            lines += [f"{s.label}: {s.path}{budget}",
                      f"  user transcript: {s.user_transcript!r}",
                      f"  answer:          {s.answer!r}",
                      f"  answer heard:    {s.answer_heard!r}"]
        lines.append(f"{'stage':14s} {'agreement':>16s} {'first diverges':>15s}")
        for i in self.ids:
            first = "-" if i.first_divergence is None else f"frame {i.first_divergence}"
            lines.append(f"{i.stage:14s} {f'{i.equal}/{i.total}':>16s} {first:>15s}")
        lines.append(f"{'stage':14s} {'SNR dB':>10s} {'max abs':>11s} {'max rel':>10s}")
        for f in self.floats:
            snr = "inf" if math.isinf(f.snr_db) else f"{f.snr_db:.1f}"
            lines.append(f"{f.stage:14s} {snr:>10s} {f.max_abs:>11.3g} {f.max_rel:>10.3g}")
        same = [self.a.user_transcript == self.b.user_transcript, self.a.answer == self.b.answer,
                self.a.answer_heard == self.b.answer_heard]
        lines.append("same user transcript: {}; same answer: {}; same answer heard: {}".format(
            *("yes" if x else "no" for x in same)))
        return "\n".join(lines)


def float_stage(stage: str, a: np.ndarray, b: np.ndarray) -> FloatStage:
    """B against A over their common length (a longer side's tail is not compared)."""
    a = np.asarray(a, np.float64).reshape(-1)
    b = np.asarray(b, np.float64).reshape(-1)
    n = min(a.size, b.size)
    error = a[:n] - b[:n]
    noise, signal = float(np.sum(error**2)), float(np.sum(a[:n] ** 2))
    snr = math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-30) / noise)
    peak = float(np.max(np.abs(a[:n]))) if n else 0.0
    max_abs = float(np.max(np.abs(error))) if n else 0.0
    return FloatStage(stage, snr, max_abs, max_abs / peak if peak else 0.0)


def id_stage(stage: str, a: np.ndarray, b: np.ndarray) -> IdStage:
    """Frames (rows) equal, and the first that differs; a length difference counts."""
    a, b = np.asarray(a), np.asarray(b)
    a = a.reshape(a.shape[0], -1) if a.size else a.reshape(0, 1)
    b = b.reshape(b.shape[0], -1) if b.size else b.reshape(0, 1)
    n = min(len(a), len(b))
    same = np.all(a[:n] == b[:n], axis=1)
    differ = np.flatnonzero(~same)
    first = int(differ[0]) if differ.size else (None if len(a) == len(b) else n)
    return IdStage(stage, int(same.sum()), max(len(a), len(b)), first)


def _load(path: str, memory_budget: float | None) -> tuple[Any, Any]:
    from ..loader import load

    if memory_budget is None:
        return load(path)
    if "memory_budget" not in inspect.signature(load).parameters:
        raise ValueError("--memory-budget: this build's loader takes no memory budget")
    return load(path, memory_budget=memory_budget)  # type: ignore[call-arg]


def teacher_forced(model: Any, config: Any, projected: Any, text_ids: np.ndarray,
                   function_ids: np.ndarray, codes: np.ndarray) -> dict[str, np.ndarray]:
    """The LLM's text logits, the EAR-TTS backbone's hidden states and the MoG
    head's mixture logits, each position fed the given previous tokens."""
    import mlx.core as mx

    frames = min(len(text_ids), projected.shape[1])
    first = np.array([config.pad_token_id])
    prev_text = mx.array(np.concatenate([first, text_ids[: frames - 1]])[None], mx.int32)
    prev_function = mx.array(np.concatenate([first, function_ids[: frames - 1]])[None],
                             mx.int32)
    stt = model.stt_model
    embeds = stt.fuse(prev_text, projected[:, :frames].astype(mx.float32), prev_function)
    text_logits, _ = stt(embeds)
    tts = model.tts_model.tts_model
    previous = np.concatenate([np.zeros_like(codes[:1]), codes[: frames - 1]])
    audio = tts.embed_code(tts.embed_codes(mx.array(previous[None], mx.int32)))
    text = mx.concatenate([tts.embed_subword.token(int(i)) for i in text_ids[:frames]], axis=1)
    hidden = tts.backbone(None, inputs_embeds=tts.gated_fusion_audio_text(audio, text))
    mog = tts.mog_head
    mixture = mog.proj_logits(mog.features(hidden.reshape(-1, hidden.shape[-1])))
    mx.eval(text_logits, hidden, mixture)
    return {"llm_logits": np.array(text_logits.astype(mx.float32)),
            "tts_backbone": np.array(hidden.astype(mx.float32)),
            "mog_logits": np.array(mixture.astype(mx.float32))}


def _run(label: str, path: str, budget: float | None, question: Any, options: dict,
         forced: dict[str, np.ndarray] | None) -> tuple:
    """One side's run; ``forced``: the tokens to teacher-force (None: its own)."""
    import mlx.core as mx

    from ..models.perception.perception import log_mel

    model, processor = _load(path, budget)
    voicechat = model.create_session(processor)
    config = model.config
    padded = mx.pad(question, (0, round(options["extra_decoding_seconds"]
                                        * config.input_sample_rate)))
    mel = log_mel(padded, config.audio_config)
    projected, _, encoded = model.stt_model.perception(mel, mx.array([mel.shape[1]], mx.int32))
    mx.eval(mel, projected, encoded)
    result = voicechat.generate(question, **options)
    side = Side(label, path, budget, result.user_transcript or "", result.text)
    side.arrays = {"mel": np.array(mel), "encoder": np.array(encoded),
                   "projection": np.array(projected), "waveform": np.asarray(result.audio),
                   "text_ids": np.asarray(result.text_tokens),
                   "function_ids": np.asarray(result.function_tokens),
                   "codes": np.asarray(result.audio_codes)}
    tokens = forced or {k: side.arrays[k] for k in ("text_ids", "function_ids", "codes")}
    side.arrays.update(teacher_forced(model, config, projected, tokens["text_ids"],
                                      tokens["function_ids"], tokens["codes"]))
    return side, voicechat, config.output_sample_rate


def compare_checkpoints(a: str | Path, b: str | Path, audio: Any, *,
                        budgets: tuple[float | None, float | None] = (None, None),
                        seed: int = 0, system_prompt: str | None = None,
                        extra_decoding_seconds: float = DEFAULT_EXTRA_DECODING_SECONDS,
                        temperature: float = 0.0, top_p: float | None = None,
                        step: Callable[[str], ContextManager[Any]] = lambda what: nullcontext()
                        ) -> Report:
    """Run the question ``audio`` through ``a`` and ``b`` (see the module docstring);
    ``step(what)`` wraps each phase (a progress line on a terminal)."""
    import gc

    import mlx.core as mx

    from ..runtime.audio import load_waveform
    from ..runtime.transcribe import Transcriber

    from ..config import ModelConfig
    from ..checkpoint import read_config, resolve_path

    rate = ModelConfig.from_dict(read_config(resolve_path(a))).input_sample_rate
    question = load_waveform(audio, rate)
    options = dict(seed=seed, system_prompt=system_prompt,
                   extra_decoding_seconds=extra_decoding_seconds,
                   temperature=temperature, top_p=top_p)
    with step(f"B ({b}): loading and answering"):
        side_b, voicechat, _ = _run("B", str(b), budgets[1], question, options, None)
    del voicechat
    gc.collect()
    mx.clear_cache()
    forced = {k: side_b.arrays[k] for k in ("text_ids", "function_ids", "codes")}
    with step(f"A ({a}): loading and answering"):
        side_a, voicechat, output_rate = _run("A", str(a), budgets[0], question, options,
                                              forced)
    transcriber = Transcriber(voicechat)
    with step("transcribing both answers through A"):
        for side in (side_a, side_b):
            if side.arrays["waveform"].size:
                side.answer_heard = transcriber.transcribe(side.arrays["waveform"],
                                                           sample_rate=output_rate).text
    floats = [float_stage(s, side_a.arrays[s], side_b.arrays[s]) for s in FLOAT_STAGES]
    ids = [id_stage(s, side_a.arrays[s], side_b.arrays[s]) for s in ID_STAGES]
    return Report(side_a, side_b, floats, ids)


def build_parser(prog: str = "mlx-voicechat compare") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Run one question through two checkpoints and report how "
                               "their transcripts, answers, ids and float stages agree.")
    parser.add_argument("a", help="checkpoint A (the baseline)")
    parser.add_argument("b", nargs="?", help="checkpoint B (default: A again, e.g. under "
                                             "another --memory-budget)")
    parser.add_argument("--audio", required=True, help="the question (WAV/FLAC/MP3, any rate)")
    parser.add_argument("--memory-budget", type=float, nargs="+", metavar="GIB",
                        help="GiB the model may use: one value for both sides, or A's then B's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-p", "--system-prompt", dest="system_prompt")
    parser.add_argument("--extra-decoding-seconds", type=float,
                        default=DEFAULT_EXTRA_DECODING_SECONDS)
    add_sampling(parser, " of both sides")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--verbose", action="store_true", help="an error's traceback")
    add_quiet(parser)
    return parser


def parse(argv: Sequence[str] | None, prog: str, tolerate_unknown: bool) -> argparse.Namespace:
    parser = build_parser(prog)
    args = parse_args(parser, argv, tolerate_unknown)
    budgets = args.memory_budget or [None]
    if len(budgets) > 2:
        parser.error(f"--memory-budget takes one or two values, got {len(budgets)}")
    if any(b is not None and not b > 0 for b in budgets):
        parser.error("--memory-budget must be positive GiB")
    args.budgets = (budgets[0], budgets[-1])
    if args.b is None:
        if args.budgets[0] == args.budgets[1]:
            parser.error("give checkpoint B, or two --memory-budget values for A")
        args.b = args.a
    if args.extra_decoding_seconds < 0:
        parser.error("--extra-decoding-seconds must be >= 0")
    check_sampling(parser, args)
    return args


def run(args: argparse.Namespace) -> int:
    check_model(args.a, "A")
    check_model(args.b, "B")
    check_audio_file(args.audio)
    report = compare_checkpoints(args.a, args.b, args.audio, budgets=args.budgets,
                                 seed=args.seed, system_prompt=args.system_prompt,
                                 extra_decoding_seconds=args.extra_decoding_seconds,
                                 temperature=args.temperature, top_p=args.top_p,
                                 step=lambda what: progress.step(args, what))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "mlx-voicechat compare",
         tolerate_unknown: bool = False, host: "HostServer | None" = None) -> int:
    """The command (``host``: the registry's uniform argument; compare needs nothing of it)."""
    return run_main(parse, run, argv, prog, tolerate_unknown)


if __name__ == "__main__":
    sys.exit(main())
