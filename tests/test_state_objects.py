"""The speaking half's state objects: ``state`` round trips and ``merge`` / ``extract``.

A state restored from a copy of its ``state`` and ``meta_state`` continues
bit for bit as the original does; rows merged for one step and extracted
after it end as each row stepped alone. No tolerance anywhere.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.models.cache_state import copy_arrays
from mlx_voicechat_plugin.models.codec.codec_stream import CodecRows, CodecState
from mlx_voicechat_plugin.runtime.options import DEFAULT_CONTEXT_SECONDS
from mlx_voicechat_plugin.runtime.reservation import ConversationShape, context_frames
from mlx_voicechat_plugin.runtime.rng import RandomStream
from mlx_voicechat_plugin.runtime.timeline import Timeline


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def start(tiny_start):
    return tiny_start


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b))


def _audio(model, position: int, rows: int = 1) -> mx.array:
    hidden = model.config.text_config.hidden_size
    return mx.random.normal((rows, 1, hidden), key=mx.random.key(100 + position)) * 0.5


def _run(timeline: Timeline, model, first: int, count: int) -> list[tuple]:
    out = []
    for position in range(first, first + count):
        (step,) = timeline.step(_audio(model, position))
        out.append((step.index, step.text_id, step.function_id, np.array(step.codes).tobytes()))
    return out


def _copy(timeline: Timeline, model) -> Timeline:
    return Timeline.from_state(model, copy_arrays(timeline.state), timeline.meta_state)


@pytest.mark.parametrize("use_language_cache", [True, False])
def test_a_timeline_from_its_state_continues_as_the_original(model, start, use_language_cache):
    timeline = Timeline(model, start, seed=3, use_language_cache=use_language_cache)
    _run(timeline, model, 0, 5)
    twin = _copy(timeline, model)
    assert all(_equal(a, b) for a, b in zip(twin.state, timeline.state))
    assert twin.meta_state == timeline.meta_state
    assert _run(twin, model, 5, 6) == _run(timeline, model, 5, 6)


def test_a_fresh_timeline_round_trips_and_restoring_in_place_keeps_the_layout(model, start):
    fresh = Timeline(model, start, seed=1)
    assert _run(_copy(fresh, model), model, 0, 4) == _run(Timeline(model, start, seed=1), model, 0, 4)
    timeline = Timeline(model, start, seed=2)
    _run(timeline, model, 0, 3)
    expected = _run(_copy(timeline, model), model, 3, 3)
    timeline.state = copy_arrays(timeline.state)  # the same layout, new arrays
    assert _run(timeline, model, 3, 3) == expected


def test_merged_rows_step_as_each_row_alone_and_extract_back(model, start):
    rows = [Timeline(model, start, seed=s) for s in (0, 1, 2)]
    rows.append(Timeline(model, start, seed=3, use_language_cache=False))  # full recompute
    for b, row in enumerate(rows):
        _run(row, model, 0, b)  # rows at different positions; row 0 at its first
    alone = [_copy(row, model) for row in rows]
    for position in range(3):
        merged = Timeline.merge(rows)
        audio = mx.concatenate([_audio(model, 10 * b + position) for b in range(len(rows))])
        steps = merged.step(audio)
        rows = [merged.remove(0) for _ in range(len(rows))]
        for b, (step, twin) in enumerate(zip(steps, alone)):
            (want,) = twin.step(_audio(model, 10 * b + position))
            assert (step.index, step.text_id, step.function_id) == \
                (want.index, want.text_id, want.function_id)
            assert _equal(step.codes, want.codes)
    for row, twin in zip(rows, alone):
        assert row.meta_state == twin.meta_state
        assert all(_equal(a, b) for a, b in zip(row.state, twin.state))


def test_one_row_merges_and_extracts_as_itself(model, start):
    timeline = Timeline(model, start)
    assert Timeline.merge([timeline]) is timeline and timeline.remove(0) is timeline


def test_a_random_stream_from_its_state_draws_the_same_keys():
    stream = RandomStream(7)
    stream.next()
    twin = RandomStream.from_state(copy_arrays(stream.state))
    assert _equal(twin.take(4), stream.take(4))
    stream.state = []
    assert stream.key is None and stream.state == []


def test_codec_streams_in_different_phases_decode_as_each_alone(model):
    codec = model.tts_model.audio_codec
    q = model.config.tts_config.num_quantizers
    size = model.config.tts_config.codebook_size
    streams = [codec.make_state() for _ in range(4)]
    twins = [codec.make_state() for _ in range(4)]

    def codes(frame: int, b: int) -> mx.array:
        return mx.random.randint(0, size, (1, q, 1), key=mx.random.key(1000 * b + frame))

    for b in range(4):  # stream b starts b frames late: phases differ, two agree
        for frame in range(min(b, 2)):
            for state in (streams[b], twins[b]):
                codec.decode_step(codes(frame, b), state)
    assert len({s.meta_state for s in streams}) == 2
    rows = CodecRows.merge(streams)  # stacked once, by phase; stepped as one from here
    assert len(rows.groups) == 2
    for frame in range(2, 6):
        got = codec.decode_streams(mx.concatenate([codes(frame, b) for b in range(4)]), rows)
        mx.eval([a for a, _ in got], rows.state)
        for b in range(4):
            want = codec.decode_step(codes(frame, b), twins[b])
            waveform, row = got[b]
            assert _equal(waveform[row : row + 1], want)
            own = rows.extract(b)
            assert own.meta_state == twins[b].meta_state
            assert all(_equal(x, y) for x, y in zip(own.state, twins[b].state))
            assert rows.row_nbytes(b) == sum(a.nbytes for a in own.state)
    assert len(rows.groups) == 1  # the late streams' phase met the others': one stack


def test_codec_states_merge_only_in_the_same_phase(model):
    codec = model.tts_model.audio_codec
    fresh, other = codec.make_state(), codec.make_state()
    merged = CodecState.merge([fresh, other])
    assert merged.batch_size == 2 and CodecState.merge([fresh]) is fresh
    assert all(_equal(x, y) for x, y in zip(merged.extract(1).state, other.state))
    codec.decode_step(mx.zeros((1, model.config.tts_config.num_quantizers, 1), mx.int32), other)
    with pytest.raises(ValueError, match="same phase"):
        CodecState.merge([fresh, other])
    twin = CodecState.from_state(copy_arrays(other.state), other.meta_state)
    assert twin.meta_state == other.meta_state


def test_a_conversation_restored_mid_stream_continues_as_the_original(tiny_ckpt):
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.runtime.events import AssistantTextDelta, Audio
    from mlx_voicechat_plugin.testing.fixtures import question_signal

    model, processor = load(tiny_ckpt)
    voicechat = model.create_session(processor)
    audio = question_signal(2.0)
    original, restored = (voicechat.create_streaming_session(seed=4) for _ in range(2))

    def outputs(events: list) -> list:
        return [(type(e).__name__, e.audio_codes.tobytes() if isinstance(e, Audio)
                 else e.token_id if isinstance(e, AssistantTextDelta) else None)
                for e in events]

    chunks = [audio[i : i + 1280] for i in range(0, len(audio), 1280)]
    got, want = [], []
    for index, chunk in enumerate(chunks):
        if index == 12:
            compute = restored.conversation.compute
            compute.state = copy_arrays(compute.state)  # the same layout, new arrays
            compute.restore(copy_arrays(compute.state), compute.meta_state)
        want += original.push_audio(chunk)
        got += restored.push_audio(chunk)
    assert outputs(got) == outputs(want)


def test_a_whole_signal_source_refuses_a_snapshot_with_perception_state():
    from mlx_voicechat_plugin.runtime.compute import WholeSignal

    source = WholeSignal(mx.zeros((1, 3, 4)), mx.zeros((1, 3, 4)))
    source.state = []  # an offline conversation's own snapshot: nothing to restore
    assert source.state == []
    with pytest.raises(ValueError, match="whole-signal source carries no state, got 2 arrays"):
        source.state = [mx.zeros((1, 2)), mx.zeros((1, 2))]  # a streaming encoder's state


def test_a_fresh_row_merged_after_talking_rows_keeps_them_stacked_and_each_row_comes_back(
        model, start):
    shape = ConversationShape(0, start.positions, context_frames(DEFAULT_CONTEXT_SECONDS,
                                                                 model.config.frame_duration))
    rows = [Timeline(model, start, seed=s, context=shape.windows()) for s in (4, 5, 6, 7)]
    for row in rows[:3]:
        _run(row, model, 0, 2)  # they talk (bounded contexts: their rings stack)
    alone = [_copy(row, model) for row in rows]
    sizes = [sum(a.nbytes for a in row.state) for row in rows]
    merged = Timeline.merge(rows)
    assert [merged.row_nbytes(b) for b in range(4)] == sizes
    fresh, middle = merged.remove(3), merged.remove(1)  # before any step: each its own again
    for row, twin in zip((fresh, middle), (alone[3], alone[1])):
        assert row.meta_state == twin.meta_state
        assert all(_equal(a, b) for a, b in zip(row.state, twin.state))
    merged = Timeline.merge([merged, fresh])  # two talking rows and the fresh one step
    audio = mx.concatenate([_audio(model, 30 + b) for b in (0, 2, 3)])
    for step, b in zip(merged.step(audio), (0, 2, 3)):
        (want,) = alone[b].step(_audio(model, 30 + b))
        assert (step.index, step.text_id, step.function_id) == \
            (want.index, want.text_id, want.function_id)
        assert _equal(step.codes, want.codes)
