"""The GPU bench (bench/gpu.py) runs end to end: a smoke run on the tiny fixture, on the CPU.

Its figures are for a GPU; here it only has to produce every section of its
report (one session per stage on both sides, the pool's batch curve with
kernels and the batched-row checks, the tiny generate and stream timings).
"""

from __future__ import annotations

import json

from bench import gpu


def test_gpu_bench_smoke_run_writes_every_section(tmp_path):
    out = tmp_path / "bench-gpu.json"
    assert gpu.main(["--size", "tiny", "--batches", "1,2", "--frames", "3", "--warm-frames", "3",
                     "--steps", "2", "--tiny-seconds", "0.3", "--no-compile",
                     "--out", str(out), "--plot", str(tmp_path / "bench-gpu.png")]) == 0
    report = json.loads(out.read_text())
    assert report["size"] == "tiny" and report["batches"] == [1, 2]
    for side in ("plugin", "reference"):
        assert set(report["single"][side]["stages_p50_ms"]) == set(gpu.STAGES)
        assert report["single"][side]["frame"]["p50_ms"] > 0
    agreement = report["agreement"]
    for stage in ("text_ids", "function_ids", "codes"):
        assert agreement[stage]["equal"] == agreement[stage]["total"] > 0, agreement[stage]
    pool = report["pool"]
    assert [r["sessions"] for r in pool] == [1, 2]
    assert all(r["row0_equals_solo"] for r in pool)  # exact on the CPU
    assert all(r["kernels_per_step"] > 0 and r["state_bytes_per_session_start"] > 0 for r in pool)
    rows = report["rows"]  # staggered sessions: masked batched cores, and the per-row ones
    assert rows["batched"]["row0_equals_solo"] and rows["per_row"]["row0_equals_solo"]
    assert rows["batched"]["max_abs_samples"] == 0.0
    assert set(report["tiny"]) >= {"plugin_generate_s", "reference_generate_s",
                                   "plugin_stream_s", "reference_stream_s"}
