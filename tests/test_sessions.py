"""Many sessions on one loaded model: exact per-session outputs, budgets, fairness,
failure isolation, the server's slots and its metrics."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    configure,
    connect,
    connect_storm,
    running,
    send,
    until_closed,
)

from mlx_voicechat_plugin.runtime.events import (
    AssistantTextDelta,
    Audio,
    FunctionDelta,
    UserTranscriptDelta,
)
from mlx_voicechat_plugin.runtime.options import ConversationOptions
from mlx_voicechat_plugin.runtime.pool import PoolFull, StreamPool
from mlx_voicechat_plugin.runtime.reservation import Reservations
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal


@pytest.fixture(scope="module")
def voicechat(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


def _outputs(events) -> dict:
    return {
        "text": [e.token_id for e in events if isinstance(e, AssistantTextDelta)],
        "function": [e.token_id for e in events if isinstance(e, FunctionDelta)],
        "transcript": "".join(e.delta for e in events if isinstance(e, UserTranscriptDelta)),
        "codes": [e.audio_codes.tolist() for e in events if isinstance(e, Audio)],
        "samples": b"".join(e.samples.tobytes() for e in events if isinstance(e, Audio)),
    }


def _alone(voicechat, audio, **options) -> dict:
    stream = voicechat.create_streaming_session(**options)
    events = []
    for start in range(0, len(audio), FRAME):
        events += stream.push_audio(audio[start : start + FRAME])
    return _outputs(events + stream.flush())


SCENARIOS = {  # id -> (first step, seconds of audio, options)
    "different prompts, seeds, starts and ends": {
        "a": (0, 1.2, dict(seed=1)),
        "b": (3, 0.8, dict(seed=2, system_prompt="Be brief.")),
        "c": (5, 1.6, dict(seed=3, system_prompt="You are a pirate.")),
    },
    # A session without the perception cache pushes its frames on its own; the
    # others stay one hearing batch.
    "one session without the perception cache": {
        "a": (0, 1.2, dict(seed=6)),
        "b": (1, 1.0, dict(seed=7, use_perception_cache=False)),
        "c": (2, 1.2, dict(seed=8)),
    },
    # A session's own nucleus is its rows' (per-row top_p in the speech head).
    "one session with its own top_p beside default ones": {
        "a": (0, 1.2, dict(seed=1)),
        "b": (1, 1.2, dict(seed=2, top_p=0.5)),
        "c": (2, 1.0, dict(seed=3, top_p=1.0)),
    },
    # A fresh session's first position (no prompt: it neither talks nor has its
    # Mamba2 states yet) beside rows that talk: they stay stacked, it runs on its own.
    "a fresh session joins two that talk": {
        "a": (0, 1.2, dict(seed=1)),
        "b": (1, 1.2, dict(seed=2)),
        "c": (4, 0.8, dict(seed=3)),
    },
    # ... and one leaves at the step it joins, another the step after.
    "a fresh session joins as others leave": {
        "a": (0, 0.4, dict(seed=4)),
        "b": (1, 0.56, dict(seed=5)),
        "c": (2, 1.2, dict(seed=6)),
        "d": (5, 0.8, dict(seed=7)),
    },
    # Past 70 frames every encoder window is full: the steady stack runs batched.
    "past the encoder's full windows": {
        "a": (0, 6.4, dict(seed=4)),
        "b": (2, 6.2, dict(seed=5)),
    },
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_each_session_of_a_shared_run_equals_that_session_alone(voicechat, scenario):
    SESSIONS = SCENARIOS[scenario]
    audio = {k: question_signal(s, seed=i) for i, (k, (_, s, _)) in enumerate(SESSIONS.items())}
    pool = StreamPool(voicechat, max_sessions=len(SESSIONS))
    events: dict[str, list] = {k: [] for k in SESSIONS}
    cursor = dict.fromkeys(SESSIONS, 0)
    step = 0
    while any(cursor[k] < len(audio[k]) for k in SESSIONS) or len(pool):
        for k, (first, _, options) in SESSIONS.items():
            if step == first:
                pool.open(k, ConversationOptions(**options))
        frames = {}
        for k in SESSIONS:
            if k in pool and cursor[k] + FRAME <= len(audio[k]):
                frames[k] = audio[k][cursor[k] : cursor[k] + FRAME]
                cursor[k] += FRAME
            elif k in pool:  # its input ended: it leaves at this step (its partial frame)
                events[k] += pool.flush(k, partial=audio[k][cursor[k]:])
                cursor[k] = len(audio[k])
                pool.close(k)
        result = pool.step(frames)
        assert not result.errors and result.size == len(frames)
        for k, chunk in result.events.items():
            events[k] += chunk
        step += 1
    for k, (_, _, options) in SESSIONS.items():
        assert _outputs(events[k]) == _alone(voicechat, audio[k], **options), k


def test_a_sessions_top_p_changes_its_codes_and_only_its_own(voicechat):
    """The nucleus is a session option: 0.5 samples other codes than the checkpoint's
    0.95 (so the shared-run scenario above tells per-row top_p from a shared one)."""
    audio = question_signal(1.2, seed=0)
    default = _alone(voicechat, audio, seed=2)
    assert _alone(voicechat, audio, seed=2, top_p=0.5)["codes"] != default["codes"]
    assert _alone(voicechat, audio, seed=2, top_p=None) == default


def _same_codec_state(got, want) -> bool:
    return got.meta_state == want.meta_state and all(
        x.dtype == y.dtype and mx.array_equal(x, y).item() for x, y in zip(got.state, want.state))


def test_a_steady_pool_step_keeps_the_codec_stack_and_a_change_hands_each_row_its_own(
        voicechat, monkeypatch):
    """The codec state of the conversations that step together is stacked once, when the
    batch forms (a late joiner's phase is its own group until it meets the others'), then
    stepped in place: a steady step merges and extracts nothing. A membership change hands
    each row back its own state, equal to that conversation's stepped alone."""
    from mlx_voicechat_plugin.models.codec.codec_stream import CodecRows, CodecState

    joins = {"a": 0, "b": 0, "c": 1}  # c joins a step late: a fresh stream, another phase
    audio = {k: question_signal(0.8, seed=i) for i, k in enumerate(joins)}
    pool = StreamPool(voicechat, max_sessions=3)
    alone = {k: voicechat.create_streaming_session(seed=i) for i, k in enumerate(joins)}
    moves: list[str] = []
    for owner, name in ((CodecRows, "merge"), (CodecState, "merge"), (CodecState, "extract")):
        method = getattr(owner, name)
        wrap = ((lambda m, n: classmethod(lambda cls, *a: (moves.append(n), m(*a))[1]))
                if name == "merge" else
                (lambda m, n: lambda self, *a: (moves.append(n), m(self, *a))[1]))
        monkeypatch.setattr(owner, name, wrap(method, f"{owner.__name__}.{name}"))

    def step(keys, frame) -> list[str]:
        """The pool's step, then each one's alone; what the pool's merged or extracted."""
        chunk = slice(frame * FRAME, (frame + 1) * FRAME)
        moves.clear()
        result = pool.step({k: audio[k][chunk] for k in keys})
        assert not result.errors and result.size == len(keys)
        pooled = list(moves)
        for k in keys:
            alone[k].push_audio(audio[k][chunk])
        return pooled

    for k, i in joins.items():
        if i == 0:
            pool.open(k, ConversationOptions(seed=list(joins).index(k)))
    step("ab", 0)
    pool.open("c", ConversationOptions(seed=2))
    step("abc", 1)  # the batch forms: a and b in one phase, c in its own
    assert pool.batch.members and len(pool.batch.codec.groups) == 2
    step("abc", 2)  # c's phase met the others': stacked once more, as one
    held = pool.batch.codec
    (rows, stacked), = held.groups
    assert rows == [0, 1, 2]
    for frame in (3, 4):  # steady: the same objects, stepped in place, nothing moved
        assert step("abc", frame) == []
        assert pool.batch.codec is held and held.groups[0][1] is stacked
    # No member keeps a copy of its own meanwhile; its bytes are read from its row.
    assert all(pool.sessions[k].core.compute.codec is None for k in joins)
    assert [pool.batch.nbytes(pool.sessions[k].core.compute) for k in joins] == [
        alone[k].core.compute.nbytes for k in joins]
    solo = alone["a"].core.compute.codec  # a conversation alone: its own state, in place
    step("ac", 5)  # b pauses: its row goes back to it, the others stay stacked
    assert pool.batch.codec is held and alone["a"].core.compute.codec is solo
    assert held.size == 2 and pool.sessions["b"].core.compute.codec is not None
    for k in joins:
        pool.extract(k)  # a read of one session's state: its rows out as its own
        assert _same_codec_state(pool.sessions[k].core.compute.codec,
                                 alone[k].core.compute.codec), k


def test_a_held_batch_is_the_only_copy_of_its_members_mamba2_states(voicechat):
    """While the batch holds the conversations' Mamba2 states stacked, no member keeps
    its own arrays of them (a second copy the pool's count would not see); when the
    batch changes each member gets its own back, equal to that conversation alone."""
    from mlx_vlm.models.cache import ArraysCache

    from mlx_voicechat_plugin.models.language.duplex import LanguageRows

    audio = {k: question_signal(0.6, seed=i) for i, k in enumerate("ab")}
    pool = StreamPool(voicechat, max_sessions=2)
    alone = {k: voicechat.create_streaming_session(seed=i) for i, k in enumerate("ab")}
    for i, k in enumerate("ab"):
        pool.open(k, ConversationOptions(seed=i))

    def own_mamba(k: str) -> list:
        timeline = pool.extract(k).core.compute.timeline  # its rows out as its own
        return [a for c in timeline.language[0].cache if isinstance(c, ArraysCache)
                for a in c.cache]

    for frame in range(4):
        chunk = slice(frame * FRAME, (frame + 1) * FRAME)
        assert not pool.step({k: audio[k][chunk] for k in "ab"}).errors
        for k in "ab":
            alone[k].push_audio(audio[k][chunk])
    stacked = pool.batch.timeline.language[0]
    assert isinstance(stacked, LanguageRows)
    assert all(pool.sessions[k].core.compute.timeline is None for k in "ab")  # books only
    assert all(a is None for row in stacked.rows for c in row.cache
               if isinstance(c, ArraysCache) for a in c.cache)
    chunk = slice(4 * FRAME, 5 * FRAME)
    pool.step({"a": audio["a"][chunk]})  # b pauses: its rows go back; a is alone, its own
    alone["a"].push_audio(audio["a"][chunk])
    for k in "ab":
        mine = own_mamba(k)
        theirs = [a for c in alone[k].core.compute.timeline.language[0].cache
                  if isinstance(c, ArraysCache) for a in c.cache]
        assert mine and all(x is not None and mx.array_equal(x, y).item()
                            for x, y in zip(mine, theirs)), k


def test_a_paused_session_keeps_none_of_the_batch_it_left_alive(voicechat):
    """A session that pauses takes its rows back as its own copies: the batch the others
    go on in, and the one they left, are not kept alive through it. MLX's active bytes
    while one of four sessions is paused stay those of the four stepping (a slice of the
    old batch would keep all four sessions' old state alive beside the new batch)."""
    import gc

    keys = "abcd"
    audio = {k: question_signal(1.2, seed=i) for i, k in enumerate(keys)}

    def active() -> int:
        gc.collect()
        mx.clear_cache()
        return mx.get_active_memory()

    def run(pool, stepping, frames):
        for frame in frames:
            chunk = slice(frame * FRAME, (frame + 1) * FRAME)
            assert not pool.step({k: audio[k][chunk] for k in stepping}).errors

    warm = StreamPool(voicechat, max_sessions=4)  # the batch sizes' graphs, traced once
    for i, k in enumerate(keys):
        warm.open(k, ConversationOptions(seed=i))
    run(warm, keys, range(3))
    run(warm, keys[1:], range(3, 6))
    warm.close_all()
    before = active()
    pool = StreamPool(voicechat, max_sessions=4)
    for i, k in enumerate(keys):
        pool.open(k, ConversationOptions(seed=i))
    run(pool, keys, range(6))
    together = active() - before
    run(pool, keys[1:], range(6, 12))  # a pauses: its rows leave, the others stay stacked
    paused = active() - before
    assert together > 0 and paused <= together * 1.05, (together, paused)


def test_a_step_runs_at_most_the_one_frame_each_session_was_given(voicechat):
    pool = StreamPool(voicechat, max_sessions=2)
    pool.open("fast")
    pool.open("idle")
    result = pool.step({"fast": np.zeros(FRAME, np.float32)})
    assert result.frames == 1 and set(result.events) == {"fast"}
    assert pool.get("idle").frame_index == 0  # a session that sends nothing costs nothing
    pool.close_all()


def test_one_sessions_bad_input_fails_only_that_session(voicechat):
    pool = StreamPool(voicechat, max_sessions=2)
    pool.open("good")
    pool.open("bad")
    result = pool.step({"good": question_signal(0.08),
                        "bad": np.zeros(FRAME // 2, np.float32)})  # not one frame
    assert set(result.errors) == {"bad"} and f"{FRAME} samples" in str(result.errors["bad"])
    assert result.events["good"] and pool.get("good").frame_index == 1
    again = pool.step({"bad": np.zeros(FRAME, np.float32)})  # still usable
    assert not again.errors and pool.get("bad").frame_index == 1
    pool.close_all()


def test_a_pool_session_holds_no_framer_its_caller_frames_and_hands_the_partial(voicechat):
    from mlx_voicechat_plugin.runtime.options import TranscriptionOptions

    pool = StreamPool(voicechat, max_sessions=2)
    talk, text = pool.open("talk"), pool.open("text", TranscriptionOptions())
    assert talk.framer is None and text.framer is None  # the server's channel holds the one
    with pytest.raises(RuntimeError, match="handed whole frames"):
        talk.push_audio(np.zeros(FRAME, np.float32))
    pool.step({"talk": question_signal(0.08)})
    assert pool.state_bytes == pool.nbytes("talk") + pool.nbytes("text")  # state only: no PCM of its own
    padded = pool.flush("talk", partial=question_signal(0.08)[: FRAME // 2])
    assert padded[-1].frame_index == 2  # the partial frame ran, zero-padded
    assert pool.flush("text")[-1].frame_index == 0  # no partial: none runs
    pool.close_all()


def test_slots_and_state_budget_refuse_clearly_and_free_on_close(voicechat):
    pool = StreamPool(voicechat, max_sessions=2)
    pool.open("one")
    one = pool.state_bytes
    assert one == pool.get("one").nbytes > 0  # measured from the session's arrays
    pool.open("two")
    with pytest.raises(PoolFull, match="--max-sessions 2"):
        pool.open("three")
    pool.close("one")
    assert pool.state_bytes == pool.get("two").nbytes
    pool.open("three")
    pool.close_all()
    assert pool.state_bytes == 0 and not len(pool)

    # Admission counts each session's reservation, its worst-case state (issue 34).
    reserved = Reservations(voicechat).of(ConversationOptions(), 0)
    assert reserved > one
    budget = StreamPool(voicechat, max_sessions=8, max_state_bytes=reserved + reserved // 2)
    budget.open("first")
    with pytest.raises(PoolFull, match="--max-state-bytes"):
        budget.open("second")
    assert len(budget) == 1  # the refused session's state is gone
    budget.close_all()


@pytest.mark.parametrize("bad", [dict(max_sessions=0), dict(max_sessions=True),
                                 dict(max_state_bytes=0)])
def test_pool_budgets_are_validated(voicechat, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        StreamPool(voicechat, **bad)


# --- the server ------------------------------------------------------------------

MAX = 4
CLIENTS = 50


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=5, idle_timeout=5, max_sessions=MAX)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits)))


def test_a_fifty_way_connect_storm_admits_exactly_max_sessions(server):
    import httpx

    server.wait_idle()
    results = connect_storm(server, CLIENTS, MAX)
    assert results.count(("created", None)) == MAX
    assert results.count(("server_busy", 1013)) == CLIENTS - MAX
    text = httpx.get(server.http("/metrics")).text
    assert f"voicechat_admissions_refused_total {float(CLIENTS - MAX)}" in text


def _server_stream(server, audio, seed, leave_after=None) -> dict:
    events = []
    with connect(server.ws()) as ws:
        configure(ws, seed=seed)
        for i, start in enumerate(range(0, len(audio), FRAME)):
            if leave_after is not None and i == leave_after:
                return {}  # disconnects mid-stream
            send(ws, append_message(audio[start : start + FRAME]))
        send(ws, {"type": "input_audio_buffer.commit"})
        events, code = until_closed(ws)
        assert code == 1000
    return {
        "text": [e["delta"] for e in events if e["type"] == "response.text.delta"],
        "transcript": "".join(e["delta"] for e in events
                              if e["type"].endswith("input_audio_transcription.delta")),
        "audio": [e["delta"] for e in events if e["type"] == "response.audio.delta"],
    }


def test_concurrent_sessions_stream_what_each_streams_alone_and_a_leaver_frees_its_slot(server):
    server.wait_idle()
    audio = [question_signal(1.0, seed=i) for i in range(3)]
    alone = [_server_stream(server, a, seed=i) for i, a in enumerate(audio)]
    results: dict[int, dict] = {}

    def run(i: int) -> None:
        results[i] = _server_stream(server, audio[i], seed=i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    leaver = threading.Thread(target=_server_stream, args=(server, audio[0], 9, 4))
    for thread in [*threads, leaver]:
        thread.start()
    for thread in [*threads, leaver]:
        thread.join(60)
    assert [results[i] for i in range(3)] == alone
    server.wait_idle()
    health = server.health().json()
    assert health["sessions"] == 0 and health["max_sessions"] == MAX and health["state_bytes"] == 0


def test_metrics_count_the_frames_that_ran(server):
    import httpx

    def frames() -> float:
        text = httpx.get(server.http("/metrics")).text
        line = next(l for l in text.splitlines() if l.startswith("voicechat_frames_total"))
        return float(line.split()[-1])

    server.wait_idle()
    before = frames()
    _server_stream(server, np.zeros(5 * FRAME, np.float32), seed=0)
    assert frames() - before == 5  # five whole frames; the commit pads nothing


def _offline_events(voicechat, audio, seed) -> list:
    return [e for item in voicechat.stream_generate(audio, seed=seed, extra_decoding_seconds=0.0)
            for e in item.events]


def test_two_pools_and_an_offline_turn_on_one_model_each_run_as_alone(voicechat):
    """The model keeps nothing between calls: two pools stepping in turn on one model, with
    an offline turn's frames between their steps, give each of their sessions, and the
    turn, what it gives alone (bounded contexts: each pool's rows attend through their
    own KV arenas)."""
    options = {"a1": dict(seed=1), "a2": dict(seed=2, system_prompt="Be brief."),
               "b1": dict(seed=3), "b2": dict(seed=4)}
    options = {k: dict(o, context_seconds=1.0) for k, o in options.items()}
    audio = {k: question_signal(0.8 + 0.16 * i, seed=i) for i, k in enumerate(options)}
    turn = question_signal(0.4, seed=9)
    pools = {"a": StreamPool(voicechat, max_sessions=2), "b": StreamPool(voicechat, max_sessions=2)}
    for k, o in options.items():
        pools[k[0]].open(k, ConversationOptions(**o))
    events: dict[str, list] = {k: [] for k in options}
    offline = voicechat.stream_generate(turn, seed=5, extra_decoding_seconds=0.0)
    offline_events: list = []
    cursor = dict.fromkeys(options, 0)
    while any(len(p) for p in pools.values()):
        for name, pool in pools.items():
            frames = {}
            for k in list(pool.sessions):
                if cursor[k] + FRAME <= len(audio[k]):
                    frames[k] = audio[k][cursor[k] : cursor[k] + FRAME]
                    cursor[k] += FRAME
                else:
                    events[k] += pool.flush(k, partial=audio[k][cursor[k]:])
                    pool.close(k)
            result = pool.step(frames)
            assert not result.errors
            for k, chunk in result.events.items():
                events[k] += chunk
            item = next(offline, None)  # a frame of the offline turn between the pools' steps
            if item is not None:
                offline_events += item.events
    offline_events += [e for item in offline for e in item.events]
    for k, o in options.items():
        assert _outputs(events[k]) == _alone(voicechat, audio[k], **o), k
    assert _outputs(offline_events) == _outputs(_offline_events(voicechat, turn, seed=5))
