"""Run the plugin and the upstream reference side by side and diff every stage.

    python -m conformance.diff CKPT WAV [--system-prompt S] [--seed N]
        [--extra-decoding-seconds X] [--reference-language-cache]

Prints one row per stage (mel, encoder, projection, text ids, function ids,
codes, waveform): exact-match count, first mismatch, max-abs, SNR. Exits 1 when
a stage is outside its tolerance. Known reference divergences are accounted
for as listed in conformance/README.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

FLOAT_TOLERANCE = {"mel": 1e-5, "encoder": 1e-5, "projection": 1e-5, "waveform": 1e-5}


@dataclass
class StageDiff:
    stage: str
    total: int
    equal: int
    first_mismatch: int | None
    max_abs: float
    snr_db: float
    tolerance: float | None  # None: must match exactly

    lengths: tuple[int, int] = (0, 0)  # (ours, reference) element counts

    @property
    def length_mismatch(self) -> bool:
        return self.lengths[0] != self.lengths[1]

    @property
    def ok(self) -> bool:
        if self.length_mismatch:
            return False  # a shorter or longer stage never passes, whatever it holds
        if self.tolerance is None:
            return self.equal == self.total
        return self.max_abs <= self.tolerance

    def row(self) -> str:
        first = "-" if self.first_mismatch is None else str(self.first_mismatch)
        snr = "inf" if math.isinf(self.snr_db) else f"{self.snr_db:.1f}"
        verdict = "ok" if self.ok else "MISMATCH"
        if self.length_mismatch:
            verdict += f" (length {self.lengths[0]} vs reference {self.lengths[1]})"
        return (f"{self.stage:12s} {self.equal:>7d}/{self.total:<7d} {first:>8s} "
                f"{self.max_abs:>10.3g} {snr:>8s}  {verdict}")


def compare(stage: str, ours: Any, reference: Any, tolerance: float | None) -> StageDiff:
    a = np.asarray(ours, dtype=np.float64).reshape(-1)
    b = np.asarray(reference, dtype=np.float64).reshape(-1)
    n = min(a.size, b.size)
    a_, b_ = a[:n], b[:n]
    if tolerance is None:
        same = a_ == b_
    else:
        same = np.abs(a_ - b_) <= tolerance
    mismatches = np.flatnonzero(~same)
    first = int(mismatches[0]) if mismatches.size else (None if a.size == b.size else n)
    max_abs = float(np.max(np.abs(a_ - b_))) if n else 0.0
    noise = float(np.sum((a_ - b_) ** 2))
    signal = float(np.sum(b_**2))
    snr = math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-30) / noise)
    equal = int(np.sum(same))
    total = max(a.size, b.size)
    return StageDiff(stage, total, equal, first, max_abs, snr, tolerance, (a.size, b.size))


def run_pair(
    checkpoint: str | Path,
    audio: str | Path | mx.array,
    *,
    system_prompt: str | None = None,
    seed: int = 0,
    extra_decoding_seconds: float = 3.0,
    reference_language_cache: bool = False,
    loaded: tuple[Any, Any] | None = None,
) -> list[StageDiff]:
    """Both implementations on one input; one :class:`StageDiff` per stage."""
    from mlx_vlm.utils import load as reference_load

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.models.perception.perception import log_mel
    from mlx_voicechat_plugin.runtime.audio import load_waveform

    (ours, processor), (ref, ref_processor) = loaded or (
        load(checkpoint), reference_load(str(checkpoint))
    )
    config = ours.config
    waveform = load_waveform(audio, config.input_sample_rate)
    padded = mx.pad(waveform, (0, round(extra_decoding_seconds * config.input_sample_rate)))

    # Float stages on the same padded input.
    from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram

    mel = log_mel(padded, config.audio_config)
    ref_mel = log_mel_spectrogram(padded, ref.config.audio_config.preprocessor)
    lengths = mx.array([mel.shape[1]], dtype=mx.int32)
    projected, _, encoded = ours.stt_model.perception(mel, lengths)
    ref_projected, _, ref_encoded = ref.stt_model.perception(ref_mel, lengths)
    diffs = [
        compare("mel", mel, ref_mel, FLOAT_TOLERANCE["mel"]),
        compare("encoder", encoded, ref_encoded, FLOAT_TOLERANCE["encoder"]),
        compare("projection", projected, ref_projected, FLOAT_TOLERANCE["projection"]),
    ]

    result = ours.create_session(processor).generate(
        waveform, system_prompt=system_prompt, seed=seed,
        extra_decoding_seconds=extra_decoding_seconds,
    )
    ref_session = ref.create_session(ref_processor)
    ref_result = ref_session.generate(
        waveform, system_prompt=system_prompt, seed=seed,
        extra_decoding_seconds=extra_decoding_seconds,
        use_language_cache=reference_language_cache,
    )
    ref_codes = np.array(ref_result.audio_codes)
    ref_audio = np.array(ref_result.audio)
    if not (system_prompt or config.default_system_prompt).strip():
        # Divergence 1: the reference leaves offline position 0 at code 0; the
        # timeline starts on codec silence. Compare against the corrected codes.
        ref_codes = ref_codes.copy()
        ref_codes[0] = np.array(ref.tts_model.codec_silence_tokens)
        decoded = ref.tts_model.audio_codec.decode(mx.array(ref_codes.T[None]))
        ref_audio = np.array(decoded[0, 0])
    diffs += [
        compare("text_ids", result.text_tokens, np.array(ref_result.text_tokens), None),
        compare("function_ids", result.function_tokens, np.array(ref_result.function_tokens), None),
        compare("codes", result.audio_codes, ref_codes, None),
        compare("waveform", result.audio, ref_audio, FLOAT_TOLERANCE["waveform"]),
        compare("transcript", [result.user_transcript == ref_result.user_transcript], [True], None),
    ]
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.diff", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("audio")
    parser.add_argument("--system-prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra-decoding-seconds", type=float, default=3.0)
    parser.add_argument("--reference-language-cache", action="store_true",
                        help="run the reference with its language cache (it defaults to recompute)")
    parser.add_argument("--stream", action="store_true", help="diff the streaming paths")
    args = parser.parse_args(argv)
    if args.stream:
        from .stream_diff import run_stream_pair

        diffs = run_stream_pair(args.checkpoint, args.audio, system_prompt=args.system_prompt,
                                seed=args.seed, extra_decoding_seconds=args.extra_decoding_seconds)
    else:
        diffs = run_pair(args.checkpoint, args.audio, system_prompt=args.system_prompt,
                         seed=args.seed, extra_decoding_seconds=args.extra_decoding_seconds,
                         reference_language_cache=args.reference_language_cache)
    print(f"{'stage':12s} {'equal/total':>15s} {'first':>8s} {'max_abs':>10s} {'snr_db':>8s}")
    for diff in diffs:
        print(diff.row())
    failed = [d.stage for d in diffs if not d.ok]
    if failed:
        print(f"mismatch beyond tolerance: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
