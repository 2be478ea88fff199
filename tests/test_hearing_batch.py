"""The hearing half's batch is the state: a pool's steady step stacks and slices none of
its rows' encoder caches or RNNT carries, and a row that leaves takes its own state
back, which goes on exactly as the row stepped alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.models.perception.encoder_cache import EncoderCache
from mlx_voicechat_plugin.models.rnnt.rnnt import RNNTCarry
from mlx_voicechat_plugin.runtime.options import ConversationOptions, TranscriptionOptions
from mlx_voicechat_plugin.runtime.pool import StreamPool
from mlx_voicechat_plugin.testing.fixtures import question_signal

FRAME = 1280


@pytest.fixture(scope="module")
def voicechat(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


@pytest.fixture
def moves(monkeypatch):
    """Every merge of more than one row and every extract from a batch of more than one,
    of encoder caches and RNNT carries, counted."""
    counted = {"merge": 0, "extract": 0}
    for kind in (EncoderCache, RNNTCarry):
        merge, extract = kind.merge.__func__, kind.extract

        def counting_merge(cls, rows, merge=merge):
            counted["merge"] += len(rows) > 1
            return merge(cls, rows)

        def counting_extract(self, index, copy=True, extract=extract):
            counted["extract"] += self.batch_size > 1
            return extract(self, index, copy)

        monkeypatch.setattr(kind, "merge", classmethod(counting_merge))
        monkeypatch.setattr(kind, "extract", counting_extract)
    return counted


def _open(pool: StreamPool, key: str) -> None:
    pool.open(key, TranscriptionOptions() if key == "text" else
              ConversationOptions(seed=ord(key[0])))


def _alone(voicechat, key: str):
    if key in ("text", "early", "late"):
        return voicechat.create_transcription_stream(options=TranscriptionOptions())
    return voicechat.create_streaming_session(options=ConversationOptions(seed=ord(key[0])))


def test_a_steady_pool_step_stacks_and_slices_no_hearing_state(voicechat, moves):
    pool = StreamPool(voicechat, max_sessions=3)
    keys = ["a", "b", "text"]
    for key in keys:
        _open(pool, key)
    audio = {k: question_signal(1.2, seed=s) for s, k in enumerate(keys)}
    held = []
    for index in range(len(audio["a"]) // FRAME):
        result = pool.step({k: a[index * FRAME : (index + 1) * FRAME] for k, a in audio.items()})
        assert not result.errors
        batch = pool.batch.hearing
        held.append((batch.perception, batch.carry, [id(c) for _, c in batch.perception.encoders.groups],
                     dict(moves)))
        pool.state_bytes  # sizing the sessions reads their rows in place
    first = held[0]
    assert first[3]["merge"] > 0  # the batch formed on the first step ...
    for perception, carry, groups, counted in held[1:]:  # ... and was the state since
        assert perception is first[0] and carry is first[1] and groups == first[2]
        assert counted == first[3]
    assert len(first[2]) == 1 and len(pool.batch.members) == 3
    pool.close_all()


def _plain(events: list) -> list:
    """Events as comparable values (arrays as their bytes)."""
    return [(type(e).__name__, {k: v.tobytes() if isinstance(v, np.ndarray) else v
                                for k, v in vars(e).items()}) for e in events]


def _arrays_equal(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()
    for x, y in zip(a, b))


def test_rows_leaving_and_joining_go_on_exactly_as_alone(voicechat, moves):
    """``b`` pauses for some steps and ``text`` joins late: a row that leaves takes its
    state back (extracts), one that joins is appended, and each session's events and
    carried state equal those of the session stepped alone on the same frames."""
    pool = StreamPool(voicechat, max_sessions=3)
    keys = ["a", "b", "text"]
    audio = {k: question_signal(1.6, seed=s + 4) for s, k in enumerate(keys)}
    frames = len(audio["a"]) // FRAME
    schedule = {"a": range(frames), "b": [i for i in range(frames) if not 4 <= i < 8],
                "text": range(6, frames)}
    for key in ("a", "b"):
        _open(pool, key)
    events = {k: [] for k in keys}
    pushed = {k: 0 for k in keys}
    extracts = []
    for index in range(frames):
        if index == schedule["text"][0]:
            _open(pool, "text")
        step = {}
        for key in keys:
            if index in schedule[key]:
                step[key] = audio[key][pushed[key] * FRAME : (pushed[key] + 1) * FRAME]
                pushed[key] += 1
        before = moves["extract"]
        result = pool.step(step)
        assert not result.errors
        extracts.append(moves["extract"] - before)
        for key, got in result.events.items():
            events[key] += got
    # b left (4): its rows given back; it came back (8): appended; steady steps none
    assert extracts[4] > 0 and extracts[9:] == [0] * (frames - 9)
    for key in keys:
        solo = _alone(voicechat, key)
        alone = []
        for n in range(pushed[key]):
            alone += solo.push_audio(audio[key][n * FRAME : (n + 1) * FRAME])
        assert _plain(events[key]) == _plain(alone), key
        assert _arrays_equal(pool.extract(key).core.compute.state, solo.core.compute.state), key
        solo.cancel()
    pool.close_all()


def test_rows_that_started_apart_batch_apart_until_their_windows_fill_then_as_one(voicechat):
    """A stream that joins later has shorter encoder windows: its row is stacked in a batch
    of its own shape while the windows fill, and once every window is full the rows are
    one batch; each stream's transcript and state equal the stream's alone."""
    pool = StreamPool(voicechat, max_sessions=2)
    pool.open("early", TranscriptionOptions())
    audio = {"early": question_signal(7.2, seed=11), "late": question_signal(7.2, seed=12)}
    late_from = 3
    window = voicechat.model.stt_model.perception.att_context[0]
    groups = []
    for index in range(len(audio["early"]) // FRAME):
        if index == late_from:
            pool.open("late", TranscriptionOptions())
        step = {"early": audio["early"][index * FRAME : (index + 1) * FRAME]}
        if index >= late_from:
            n = index - late_from
            step["late"] = audio["late"][n * FRAME : (n + 1) * FRAME]
        assert not pool.step(step).errors
        groups.append(len(pool.batch.hearing.perception.encoders.groups))
    assert groups[late_from] == 2 and groups[late_from + window - 2] == 2
    assert groups[-1] == 1 and len(groups) > late_from + window + 1, groups
    for key, skip in (("early", 0), ("late", late_from)):
        solo = _alone(voicechat, key)
        for n in range(len(groups) - skip):
            solo.push_audio(audio[key][n * FRAME : (n + 1) * FRAME])
        assert pool.get(key).transcript == solo.transcript and solo.transcript, key
        assert _arrays_equal(pool.extract(key).core.compute.state, solo.core.compute.state), key
        solo.cancel()
    pool.close_all()
