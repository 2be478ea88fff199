"""How late a session's own frames ran, counted per session and told on ``response.done``.

The engine counts a frame as late when the step that ran it took longer than
one frame of wall time (``server/engine/pace.py``); each session sums its own
(``Session.pace``) and the GA dialect puts the figures of a response, and of
the session so far, on its ``response.done`` as the ``voicechat`` extension.
The counts are counted, not assumed: a step made slow on purpose (a planted
sleep inside the timed step) moves them; the tiny model's own steps, timed
beside the engine here, count only when they too ran past a frame (they
normally run well within one, so none does).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from test_session_transport import engine  # noqa: F401  (the module's engine, tiny)

from mlx_voicechat_plugin.runtime.pool import StreamPool
from mlx_voicechat_plugin.runtime.streaming import StreamingShell
from mlx_voicechat_plugin.server.connection import connect
from mlx_voicechat_plugin.server.dialects import GA
from mlx_voicechat_plugin.server.engine import Engine
from mlx_voicechat_plugin.server.engine.pace import FramePace
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.transport.memory import MemoryTransport

FRAME_SECONDS = 0.08
SLOW_SECONDS = 0.25  # a planted step: 170 ms later than a frame of wall time
RESPONSE_SECONDS = 0.4  # five frames, run on silence once the response is owed


@pytest.fixture
def plant(monkeypatch):
    """``plant(n)``: the next ``n`` frames stepped take :data:`SLOW_SECONDS` more."""
    left = [0]
    check = StreamingShell.check_frame

    def slow_check(self):
        if left[0] > 0:
            left[0] -= 1
            time.sleep(SLOW_SECONDS)
        check(self)

    monkeypatch.setattr(StreamingShell, "check_frame", slow_check)
    return lambda n: left.__setitem__(0, n)


@pytest.fixture
def steps(monkeypatch):
    """The wall time of every pool step, as the engine measured it."""
    seconds: list[float] = []
    step = StreamPool.step

    def timed(self, frames):
        result = step(self, frames)
        seconds.append(result.seconds)
        return result

    monkeypatch.setattr(StreamPool, "step", timed)
    return seconds


def one_response(engine: Engine, before=lambda: None) -> tuple[dict, FramePace]:
    """A GA session over memory: one owed response, run on silence to its bound; its
    ``response.done`` and the session's own count."""
    async def scenario():
        transport = MemoryTransport()
        connection = connect(transport, GA, engine, "tiny", ServerLimits())
        task = asyncio.ensure_future(connection.run())
        assert (await transport.take())["type"] == "session.created"
        transport.put({"type": "session.update", "session": {
            "type": "realtime", "max_response_seconds": RESPONSE_SECONDS,
            "audio": {"input": {"turn_detection": None}}}})
        assert (await transport.take())["type"] == "session.updated"
        before()
        transport.put({"type": "input_audio_buffer.commit"})
        while (event := await transport.take())["type"] != "response.done":
            pass
        pace = connection.session.pace
        transport.hang_up()
        await asyncio.wait_for(task, 10)
        return event, pace

    return asyncio.run(scenario())


# --- the rule ------------------------------------------------------------------------


def test_a_step_within_a_frame_of_wall_time_is_not_late():
    pace = FramePace()
    pace.step(1, 0.03, FRAME_SECONDS)
    assert pace == FramePace(frames=1, late_frames=0, max_late_ms=0.0)


def test_a_step_slower_than_a_frame_makes_its_frames_late_by_the_difference():
    pace = FramePace()
    pace.step(1, 0.2, FRAME_SECONDS)
    assert (pace.frames, pace.late_frames) == (1, 1)
    assert pace.max_late_ms == pytest.approx(120.0)


def test_a_flush_of_several_frames_is_late_when_its_frames_average_over_a_frame():
    on_time, late = FramePace(), FramePace()
    on_time.step(4, 0.3, FRAME_SECONDS)  # 75 ms a frame
    late.step(4, 0.4, FRAME_SECONDS)  # 100 ms a frame
    assert (on_time.frames, on_time.late_frames) == (4, 0)
    assert (late.frames, late.late_frames) == (4, 4)
    assert late.max_late_ms == pytest.approx(20.0)


def test_paces_add_their_counts_and_keep_the_worst_lateness():
    total = FramePace(3, 1, 40.0)
    total.add(FramePace(2, 2, 10.0))
    assert total == FramePace(5, 3, 40.0)
    assert total.wire() == {"frames": 5, "late_frames": 3, "max_late_ms": 40.0}


# --- counted by the engine, told on response.done --------------------------------------


def test_response_done_tells_the_frames_its_response_ran_and_none_late(engine, steps):
    done, pace = one_response(engine)
    figures = done["voicechat"]
    assert figures["frames"] >= RESPONSE_SECONDS / FRAME_SECONDS - 1
    assert figures["session"] == pace.wire()
    assert pace.frames == len(steps) >= figures["frames"]
    assert pace.late_frames == sum(s > FRAME_SECONDS for s in steps)  # normally none


def test_planted_slow_steps_are_counted_late_for_the_response_and_the_session(
        engine, steps, plant):
    done, pace = one_response(engine, before=lambda: plant(2))
    figures = done["voicechat"]
    late = sum(s > FRAME_SECONDS for s in steps)
    assert late >= 2 and figures["late_frames"] == figures["session"]["late_frames"] == late
    assert figures["max_late_ms"] >= (SLOW_SECONDS - FRAME_SECONDS) * 1000
    assert pace.late_frames == late and round(pace.max_late_ms, 1) == figures["max_late_ms"]
