"""Per-stage matmul floors: what a frame would cost if it were only its matrix products.

    python -m bench.floors --size medium [--seeds 0,1] [--frames 40] [--rounds 5]

A stage's multiply-accumulates per frame are counted from the loaded model's
weight matrices (a rough count: every 2-D weight of a stage's linear layers
and kernel-1 convolutions, times the rows it multiplies per frame; for the
codec, every decoder layer times the frames it sees per 80 ms frame), and
divided by this machine's measured float32 matmul throughput at frame-like
shapes. The gap between a stage's measured time and its floor is its
non-matmul work and recomputation. Embedding tables are excluded (a frame
looks up rows, it does not multiply).

Run as a script it loads the plugin on each ``--seeds`` fixture of
``--size``, times plain streaming frames (``--rounds`` rounds' steady means:
the frame's real cost) and one profiled run (the stage split, with the
profiler's own barriers), and prints plugin / floor per stage and for the
whole frame. The machine may be shared, so the matmul rate is measured in
short bursts between the timed frames of each round, and the whole-frame
figure is the median of the per-round ratios. Figures, never test assertions.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def _is_matrix(value: Any) -> bool:
    """A linear layer's ``[out, in]`` weight, or a kernel-1 convolution's ``[out, 1, in]``."""
    return value.ndim == 2 or (value.ndim == 3 and value.shape[1] == 1)


def _matrix_macs(module: Any, skip: tuple[str, ...] = ()) -> int:
    """Multiply-accumulates of one row through every weight matrix of ``module``."""
    total = 0
    for name, value in tree_flatten(module.parameters()):
        if _is_matrix(value) and name.endswith("weight") and not any(s in name for s in skip):
            total += value.size
    return total


def _codec_macs(codec: Any, frames: int = 1) -> int:
    """Multiply-accumulates of the codec decoder for ``frames`` code frames (upsampling as it goes)."""
    total, rows = 0, frames
    for layer in codec.decoder.layers:
        weights = [v for k, v in tree_flatten(layer.parameters()) if k.endswith("weight") and v.ndim == 3]
        total += rows * sum(w.size for w in weights)
        if isinstance(layer, nn.ConvTranspose1d):
            rows *= layer.stride
    return total


def stage_macs(model: Any) -> dict[str, float]:
    """Rough multiply-accumulates per 80 ms frame of each stage."""
    stt, tts = model.stt_model, model.tts_model.tts_model
    config = model.config
    window = config.audio_config.encoder.att_context_size[0][0] + 1
    encoder = _matrix_macs(stt.perception, skip=("embed",))
    # Per frame the encoder projects one new row through every layer and, as
    # the reference does, K/V for the whole attention window; the floor counts
    # one row (the K/V rows cached).
    depth = sum(1 for count in tts._schedule if count)
    return {
        "perception": float(encoder),
        "perception_window_kv": float(encoder + _kv_macs(stt.perception) * (window - 1)),
        "rnnt": float(_rnnt_macs(stt, config.audio_config.max_symbols)),
        "language": float(_matrix_macs(stt.llm) + stt.lm_head.weight.size
                          + stt.function_head.weight.size),
        # CFG runs the backbone and the depth head on two rows.
        "tts": float(2 * _matrix_macs(tts.backbone, skip=("embed_tokens",))
                     + depth * _mog_macs(tts.mog_head)),
        "codec": float(_codec_macs(model.tts_model.audio_codec)),
    }


def _rnnt_macs(stt: Any, tries: int) -> int:
    """Every try runs the joint (its encoder projection once a frame) and the LSTM."""
    joint = stt.rnnt_joint
    lstm = sum(layer.Wx.size + layer.Wh.size for layer in stt.rnnt_decoder.prediction["dec_rnn"].lstm)
    return joint.enc.weight.size + tries * (_matrix_macs(joint, skip=("enc.",)) + lstm)


def _mog_macs(head: Any) -> int:
    """One depth pass of the MoG head: its MLPs on the ``[cond; uncond]`` rows, then, on
    the guided row, the heads and the sampled component's low-rank block only."""
    mlps = 2 * _matrix_macs(head, skip=("proj_", "low_mat"))
    heads = sum(getattr(head, name).weight.size for name in ("proj_logits", "proj_logs", "proj_else"))
    component = head.low_rank * head.proj_mus.weight.shape[1] + head.latent_size * head.low_rank
    return mlps + heads + component


def _kv_macs(perception: Any) -> int:
    total = 0
    for name, value in tree_flatten(perception.parameters()):
        if value.ndim == 2 and (".linear_k." in name or ".linear_v." in name):
            total += value.size
    return total


def matmul_throughput(width: int = 768, out: int = 2304, rows: int = 2, repeats: int = 200) -> float:
    """Measured multiply-accumulates per second of a ``rows x width @ width x out`` float32 matmul."""
    a = mx.random.normal((rows, width))
    b = mx.random.normal((width, out))
    mx.eval(a, b, a @ b)
    began = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    return rows * width * out * repeats / (time.perf_counter() - began)


def floors_ms(model: Any, rate: float | None = None) -> dict[str, Any]:
    """Each stage's floor in ms at ``rate`` (multiply-accumulates per second; measured if not given)."""
    rate = matmul_throughput() if rate is None else rate
    macs = stage_macs(model)
    return {"macs_per_second": rate, "macs": macs,
            "floor_ms": {k: v / rate * 1e3 for k, v in macs.items()}}


STAGES = ("perception", "rnnt", "language", "tts", "codec")


def stage_table(stage_ms: dict[str, float], floor_ms: dict[str, float],
                total_ms: float | None = None) -> dict[str, dict[str, float]]:
    """``{stage: {plugin, floor, ratio}}`` plus ``total`` (``total_ms``, or the stages' sum)."""
    table = {s: {"plugin": stage_ms[s], "floor": floor_ms[s], "ratio": stage_ms[s] / floor_ms[s]}
             for s in STAGES}
    floor = sum(floor_ms[s] for s in STAGES)
    plugin = sum(stage_ms[s] for s in STAGES) if total_ms is None else total_ms
    table["total"] = {"plugin": plugin, "floor": floor, "ratio": plugin / floor}
    return table


class RateProbe:
    """The matmul rate measured in short bursts between frames, so it sees the load they saw."""

    def __init__(self, repeats: int = 8):
        self.repeats, self.macs, self.seconds = repeats, 0.0, 0.0
        self._a, self._b = mx.random.normal((2, 768)), mx.random.normal((768, 2304))
        mx.eval(self._a, self._b)

    def burst(self) -> None:
        began = time.perf_counter()
        for _ in range(self.repeats):
            mx.eval(self._a @ self._b)
        self.seconds += time.perf_counter() - began
        self.macs += self._a.size * self._b.shape[1] * self.repeats

    @property
    def rate(self) -> float:
        return self.macs / self.seconds


def _round(session: Any, audio: Any, frame: int, skip: int, probe: RateProbe,
           profile: bool = False) -> tuple[float, Any]:
    """One stream: its steady mean frame (ms), a rate burst after every frame; the profile."""
    stream = session.create_streaming_session(profile=profile)
    times = []
    for start in range(0, len(audio) - frame + 1, frame):
        began = time.perf_counter()
        stream.push_audio(audio[start : start + frame])
        times.append((time.perf_counter() - began) * 1e3)
        if len(times) > skip:
            probe.burst()
    summary = stream.profile().summary(drop_first=skip) if profile else None
    stream.flush()
    return sum(times[skip:]) / len(times[skip:]), summary


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import tempfile
    from pathlib import Path

    import numpy as np

    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.testing.fixtures import conversation_signal, make_checkpoint

    parser = argparse.ArgumentParser(prog="python -m bench.floors")
    parser.add_argument("--size", default="medium", choices=("tiny", "small", "medium", "full"))
    parser.add_argument("--seeds", default="0,1", help="fixture seeds, comma-separated")
    parser.add_argument("--frames", type=int, default=40, help="streaming frames per round")
    parser.add_argument("--rounds", type=int, default=5, help="plain streaming rounds")
    parser.add_argument("--warm-frames", type=int, default=10,
                        help="first frames of each round left out of its steady mean")
    args = parser.parse_args(argv)
    results = {}
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = make_checkpoint(Path(tmp) / f"{args.size}-s{seed}", args.size, seed=seed)
            model, processor = load(checkpoint)
        session = model.create_session(processor)
        frame = model.config.frame_samples
        audio = conversation_signal(args.frames * model.config.frame_duration,
                                    model.config.input_sample_rate)
        _round(session, audio, frame, args.warm_frames, RateProbe())  # compile, warm caches
        macs = stage_macs(model)
        floor_macs = sum(macs[s] for s in STAGES)
        # The machine may be shared: each round's floor comes from the matmul
        # rate measured between its own frames, and the figure is the median
        # per-round ratio.
        plain, ratios = [], []
        for _ in range(args.rounds):
            probe = RateProbe()
            plain.append(_round(session, audio, frame, args.warm_frames, probe)[0])
            ratios.append(plain[-1] / (floor_macs / probe.rate * 1e3))
        probe = RateProbe()
        _, summary = _round(session, audio, frame, args.warm_frames, probe, profile=True)
        floor = {k: v / probe.rate * 1e3 for k, v in macs.items()}
        stages = {s: summary["stages"][s]["mean_ms"] for s in STAGES}
        results[seed] = {
            "plain_frame_ms": float(np.median(plain)), "plain_round_means_ms": plain,
            "frame_vs_floor": {"ratio_median": float(np.median(ratios)),
                               "ratio_spread": [min(ratios), max(ratios)]},
            "profiled": stage_table(stages, floor),
            "matmul_gmacs_per_second": probe.rate / 1e9,
        }
        print(json.dumps({"seed": seed} | results[seed], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
