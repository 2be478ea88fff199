"""The engine's per-session channels and the rule that forms batched steps (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_voicechat_plugin.server.engine.channel import Chunk, StreamChannel
from mlx_voicechat_plugin.server.engine.scheduler import (
    EXPECT_FRAMES,
    FILL_LOAD,
    FILL_MARGIN,
    BatchScheduler,
    StepCosts,
)

FRAME = 4
FRAME_SECONDS = 0.08


def _queue(*chunks: np.ndarray, now: float = 0.0, tag: object = "a") -> StreamChannel:
    queue = StreamChannel(FRAME)
    for samples in chunks:
        queue.add_chunk(Chunk(np.asarray(samples, np.float32), tag), now)
    return queue


def test_frames_are_cut_from_any_chunk_sizes_in_order():
    rng = np.random.default_rng(0)
    signal = rng.standard_normal(10 * FRAME + 3).astype(np.float32)
    cuts = np.sort(rng.choice(np.arange(1, signal.shape[0]), 12, replace=False))
    queue = _queue(*np.split(signal, cuts))
    frames = []
    while queue.frame_ready():
        frames.append(queue.take_frame(0.0)[0])
    assert len(frames) == 10
    np.testing.assert_array_equal(np.concatenate(frames), signal[: 10 * FRAME])
    assert queue.buffered == 3 and not queue.frame_ready()


def test_a_frame_belongs_to_the_chunk_that_completes_it():
    first, second = Chunk(np.zeros(3, np.float32), "x"), Chunk(np.ones(3, np.float32), "y")
    queue = StreamChannel(FRAME)
    queue.add_chunk(first, 0.0)
    assert not queue.frame_ready()
    queue.add_chunk(second, 0.0)
    _, tag = queue.take_frame(0.0)
    assert tag == second.tag and list(queue.items) == [second]
    assert queue.out.consumed == 3 + 1


def test_a_command_waits_for_the_frames_before_it_and_takes_the_partial_frame_along():
    queue = _queue(np.zeros(FRAME + 2))
    queue.add_marker("commit")
    queue.add_chunk(Chunk(np.zeros(FRAME, np.float32), "later"), 0.0)
    assert queue.head_marker() is None  # a whole frame comes first
    queue.take_frame(0.0)
    assert queue.head_marker() == "commit"
    assert queue.pop_marker(0.0) == "commit"
    # The channel keeps the 2 samples: the next frame takes only 2 more.
    assert queue.frame_ready()
    samples, tag = queue.take_frame(0.0)
    assert samples.shape[0] == FRAME and tag == "later"


def test_a_failed_frame_drops_the_rest_of_its_append_only():
    queue = _queue(np.zeros(3 * FRAME), tag="bad")
    queue.add_chunk(Chunk(np.zeros(FRAME, np.float32), "good"), 0.0)
    _, tag = queue.take_frame(0.0)
    consumed = queue.out.consumed
    queue.drop_tag(tag, 0.0)
    assert queue.out.consumed - consumed == 2 * FRAME
    assert queue.buffered == FRAME and queue.take_frame(0.0)[1] == "good"


def test_the_step_runs_at_once_when_every_streaming_session_has_a_frame():
    scheduler = BatchScheduler(0.03, FRAME_SECONDS)
    inputs = {"a": _queue(np.zeros(FRAME), now=1.0), "b": _queue(np.zeros(FRAME), now=1.0)}
    assert scheduler.wait(inputs, 1.0) == 0.0


def test_the_step_waits_for_a_streaming_session_until_the_deadline():
    scheduler = BatchScheduler(0.03, FRAME_SECONDS)
    scheduler.free_since = 1.0
    inputs = {"a": _queue(np.zeros(FRAME), now=1.0), "b": _queue(np.zeros(1), now=1.0)}
    assert scheduler.wait(inputs, 1.01) == pytest.approx(0.02)
    assert scheduler.wait(inputs, 1.03) == 0.0


def test_the_deadline_counts_from_when_the_engine_was_free():
    scheduler = BatchScheduler(0.03, FRAME_SECONDS)
    inputs = {"a": _queue(np.zeros(FRAME), now=1.0), "b": _queue(np.zeros(1), now=1.0)}
    scheduler.free_since = 1.05  # a step ran while "a"'s frame waited
    assert scheduler.wait(inputs, 1.06) == pytest.approx(0.02)


def test_a_session_that_stopped_sending_is_not_waited_for():
    scheduler = BatchScheduler(0.03, FRAME_SECONDS)
    quiet = _queue(now=0.0)
    quiet.last_arrival = 1.0
    inputs = {"a": _queue(np.zeros(FRAME), now=2.0), "quiet": quiet}
    later = 1.0 + EXPECT_FRAMES * FRAME_SECONDS + 0.001
    assert scheduler.wait(inputs, later) == 0.0
    assert scheduler.wait(inputs, 1.0 + FRAME_SECONDS) > 0.0  # recently streaming: waited for


def test_no_frame_ready_means_nothing_to_wait_for():
    assert BatchScheduler(0.03, FRAME_SECONDS).wait({"a": _queue(np.zeros(1))}, 0.0) is None


def test_a_zero_deadline_never_waits():
    scheduler = BatchScheduler(0.0, FRAME_SECONDS)
    inputs = {"a": _queue(np.zeros(FRAME), now=1.0), "b": _queue(np.zeros(1), now=1.0)}
    assert scheduler.wait(inputs, 1.0) == 0.0


def test_a_partial_frame_left_behind_does_not_hold_the_others():
    scheduler = BatchScheduler(0.03, FRAME_SECONDS)
    scheduler.free_since = 0.0
    stalled = _queue(np.zeros(1), now=1.0)  # sent part of a frame, then stopped
    inputs = {"a": _queue(np.zeros(FRAME), now=2.0), "stalled": stalled}
    assert scheduler.wait(inputs, 2.0) == 0.0


def _staggered(sessions: int, ready: int, now: float) -> dict[str, StreamChannel]:
    """``sessions`` streaming clients, the first ``ready`` of them with a frame queued."""
    return {str(i): _queue(np.zeros(FRAME if i < ready else 1), now=now)
            for i in range(sessions)}


def _costs(solo: float, **sizes: float) -> StepCosts:
    costs = StepCosts()
    costs.record(1, solo)
    for size, seconds in sizes.items():
        costs.record(int(size[1:]), seconds)
    return costs


def test_below_the_unbatched_capacity_the_short_deadline_holds():
    # 4 sessions of 10 ms each fill half a frame: no need to wait for the others.
    scheduler = BatchScheduler(0.03, FRAME_SECONDS, costs=_costs(0.010, n4=0.02))
    scheduler.free_since = 1.0
    assert not scheduler.filling(4)
    assert scheduler.wait(_staggered(4, 1, now=1.0), 1.0) == pytest.approx(0.03)


def test_past_the_unbatched_capacity_the_step_waits_to_fill_within_the_oldest_frame():
    # 8 sessions of 10 ms each would take a whole frame alone: the first ready frame
    # waits for the others until (1 - FILL_MARGIN) of a frame after it became ready.
    scheduler = BatchScheduler(0.03, FRAME_SECONDS, costs=_costs(0.010, n8=0.030))
    scheduler.free_since = 1.0
    assert 8 * 0.010 > FILL_LOAD * FRAME_SECONDS and scheduler.filling(8)
    inputs = _staggered(8, 3, now=1.0)
    latest = (1.0 - FILL_MARGIN) * FRAME_SECONDS
    assert latest > 0.03
    assert scheduler.wait(inputs, 1.0) == pytest.approx(latest)
    assert scheduler.wait(inputs, 1.0 + latest) == 0.0
    for queue in inputs.values():  # every streaming session ready: at once
        queue.add_chunk(Chunk(np.zeros(FRAME, np.float32), "b"), 1.01)
    assert scheduler.wait(inputs, 1.01) == 0.0


def test_a_saturated_engine_is_never_held_by_filling():
    # The frames became ready while the last step ran (free since 1.08): they have
    # waited a frame already, so the step runs at once.
    scheduler = BatchScheduler(0.03, FRAME_SECONDS, costs=_costs(0.015))
    inputs = _staggered(8, 7, now=1.0)
    scheduler.free_since = 1.0 + FRAME_SECONDS
    assert scheduler.filling(8)
    assert scheduler.wait(inputs, 1.0 + FRAME_SECONDS) == 0.0


def test_filling_can_be_turned_off():
    scheduler = BatchScheduler(0.03, FRAME_SECONDS, fill=False, costs=_costs(0.010, n8=0.03))
    scheduler.free_since = 1.0
    assert not scheduler.filling(8)
    assert scheduler.wait(_staggered(8, 3, now=1.0), 1.0) == pytest.approx(0.03)


def test_without_measured_steps_there_is_no_filling():
    scheduler = BatchScheduler(0.03, FRAME_SECONDS)
    assert scheduler.costs.solo() is None and not scheduler.filling(100)


def test_step_costs_are_moving_averages_and_solo_is_the_smallest_batch():
    costs = _costs(0.010, n4=0.020)
    assert costs.solo() == 0.010
    costs.record(4, 0.030)  # a moving average, not the last figure alone
    assert 0.020 < costs.by_size[4] < 0.030
    costs.record(1, 0.020)
    assert 0.010 < costs.solo() < 0.020
