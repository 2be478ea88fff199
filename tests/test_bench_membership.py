"""bench.membership runs: a pool steps, one row leaves and returns, a fresh one joins, the
figures come back."""

from __future__ import annotations

from bench.membership import measure


def test_membership_bench_reports_a_steady_step_and_the_changes_above_it():
    figures = measure("tiny", sessions=2, cycles=1)
    assert set(figures) == {"steady_ms", "leave_ms", "return_ms", "join_ms", "after_join_ms"}
    assert figures["steady_ms"] > 0
