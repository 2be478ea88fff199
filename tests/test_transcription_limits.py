"""The transcription route's default bounds follow the memory budget: what the budget leaves
the sessions, a share of it for the files in flight, never below OpenAI's 25 MiB and
600 s (``budget.transcription_bounds``; flags set by hand win)."""

from __future__ import annotations

import httpx
import pytest
from server_support import LiveServer, running

from mlx_voicechat_plugin.budget import (
    GIB, TRANSCRIPTION_FLOOR_SECONDS, TRANSCRIPTION_MAX_SCALE, TRANSCRIPTION_SHARE,
    UPLOAD_FLOOR_BYTES, MemoryPlan, transcription_bounds, transcription_host_bytes,
)
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.engine import Engine
from mlx_voicechat_plugin.server.limits import ServerLimits

FLOORS = (UPLOAD_FLOOR_BYTES, TRANSCRIPTION_FLOOR_SECONDS)


def _plan(budget_gib: float) -> MemoryPlan:
    return MemoryPlan(budget=int(budget_gib * GIB), source="--memory-budget", stored=GIB,
                      hold_extra=0, session=GIB // 8, hold_f32=False)


def test_without_a_plan_or_with_a_small_budget_the_floors_hold():
    assert transcription_bounds(None, 4) == FLOORS
    assert transcription_bounds(_plan(2), 4) == FLOORS  # OpenAI's 25 MiB, never less


def test_a_larger_budget_allows_larger_files_within_its_share():
    small, large = transcription_bounds(_plan(16), 4), transcription_bounds(_plan(64), 4)
    assert FLOORS[0] < small[0] < large[0] and FLOORS[1] < small[1] < large[1]
    plan = _plan(64)
    assert 4 * transcription_host_bytes(*large) <= plan.left * TRANSCRIPTION_SHARE + 4
    # More files in flight: a smaller share each.
    assert transcription_bounds(plan, 8)[0] < large[0]


def test_the_bounds_stop_at_their_cap():
    upload, seconds = transcription_bounds(_plan(4096), 1)
    assert upload == int(UPLOAD_FLOOR_BYTES * TRANSCRIPTION_MAX_SCALE)
    assert seconds == TRANSCRIPTION_FLOOR_SECONDS * TRANSCRIPTION_MAX_SCALE


def test_flags_set_by_hand_win_over_the_budget():
    plan = _plan(64)
    assert ServerLimits().transcription_limits(plan) == transcription_bounds(plan, 4)
    assert ServerLimits(max_upload_bytes=1000).transcription_limits(plan)[0] == 1000
    assert ServerLimits(max_transcription_seconds=9).transcription_limits(plan)[1] == 9.0


# A budget that leaves room past the floors on the tiny fixture (its weights are a few MiB).
BUDGET_GIB = 10.0


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    engine = Engine(str(tiny_ckpt), memory_budget=BUDGET_GIB)
    live = LiveServer(create_app(tiny_ckpt, limits=ServerLimits(), engine=engine))
    live.engine = engine
    yield from running(live)


def test_an_upload_over_the_budgets_limit_is_413_naming_it(server):
    assert server.engine.loaded.wait(120) and server.engine.ready
    upload, _ = ServerLimits().transcription_limits(server.engine.memory_plan)
    assert upload == transcription_bounds(server.engine.memory_plan, 4)[0] > UPLOAD_FLOOR_BYTES
    big = b"RIFF" + b"\0" * (upload - 3)  # one byte over
    response = httpx.post(server.http("/v1/audio/transcriptions"),
                          files={"file": ("big.wav", big, "audio/wav")},
                          data={"model": "voicechat"}, timeout=60)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["param"] == "file"
    assert f"exceeds the {upload}-byte limit (--max-upload-bytes)" in error["message"]
