"""Long sessions: the prompt cache and the pool with bounded contexts, admission by reservation.

A session reserves its worst-case state when it opens (a full ring and the
fixed part, computed from the config; or, unbounded, every frame up to
``max_streaming_seconds``); the pool and the server admit while the
reservations fit ``--max-state-bytes`` and the measured state never passes
them.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import numpy as np
import pytest
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    configure,
    connect,
    expect_error,
    recv,
    running,
    send,
    until_closed,
)

from mlx_voicechat_plugin.runtime.options import ConversationOptions
from mlx_voicechat_plugin.runtime.pool import PoolFull, StreamPool
from mlx_voicechat_plugin.runtime.reservation import Reservations
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.server.dialects.client_options import session_options
from mlx_voicechat_plugin.testing.fixtures import question_signal

WINDOW = 1.0  # seconds: 12 frames


@pytest.fixture(scope="module")
def voicechat(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


def _frames(stream, signal: np.ndarray, count: int) -> list[tuple]:
    out = []
    for i in range(count):
        start = (i * FRAME) % (len(signal) - FRAME)
        stream.push_audio(signal[start : start + FRAME])
        last = stream.core.last_output
        out.append((last.text_id, last.function_id, last.codes.tobytes()))
    return out


def test_a_bounded_session_from_the_prompt_cache_runs_as_one_that_prefilled(voicechat):
    signal = question_signal(3.0)
    options = dict(system_prompt="You are brief.", seed=4, context_seconds=WINDOW)
    voicechat.prompt_cache.clear()
    first = voicechat.create_streaming_session(**options)
    assert not first.core.prompt_cache_hit
    second = voicechat.create_streaming_session(**options)
    assert second.core.prompt_cache_hit
    # Past the window: the rings have wrapped three times.
    assert _frames(second, signal, 40) == _frames(first, signal, 40)
    other = voicechat.create_streaming_session(**{**options, "context_seconds": 2 * WINDOW})
    assert not other.core.prompt_cache_hit  # rings of another size: another entry
    for stream in (first, second, other):
        stream.cancel()


def test_bounded_sessions_at_different_wrap_points_step_as_each_alone(voicechat):
    signal = question_signal(2.0, seed=3)
    pool = StreamPool(voicechat, max_sessions=3)
    windows = {"a": WINDOW, "b": 0.4, "c": 0.0}  # c: unbounded
    alone = {}
    for key, window in windows.items():
        solo = voicechat.create_streaming_session(seed=1, context_seconds=window)
        alone[key] = _frames(solo, signal, 30)
        solo.cancel()
    for key, window in windows.items():
        pool.open(key, ConversationOptions(seed=1, context_seconds=window))
    got = {key: [] for key in windows}

    def chunk(key: str) -> np.ndarray:
        start = (len(got[key]) * FRAME) % (len(signal) - FRAME)
        return signal[start : start + FRAME]

    for i in range(35):
        # staggered: "b" joins after five steps, "a" and "c" stop after thirty
        keys = [k for k in windows if len(got[k]) < 30 and (k != "b" or i >= 5)]
        result = pool.step({k: chunk(k) for k in keys})
        assert not result.errors
        for key in keys:
            last = pool.get(key).core.last_output
            got[key].append((last.text_id, last.function_id, last.codes.tobytes()))
    assert got == alone
    pool.close_all()


def test_measured_state_stays_within_the_reservation_and_is_constant_past_the_window(voicechat):
    reservations = Reservations(voicechat)
    pool = StreamPool(voicechat, max_sessions=2, max_state_bytes=10**9)
    options = ConversationOptions(system_prompt="Hi.", context_seconds=WINDOW)
    stream = pool.open("one", options)
    reserved = pool.reserved["one"]
    assert reserved == reservations.of(options, stream.core.shape.prompt)
    signal = question_signal(2.0)
    sizes = []
    for i in range(80):
        start = (i * FRAME) % (len(signal) - FRAME)
        pool.step({"one": signal[start : start + FRAME]})
        sizes.append(pool.state_bytes)
    assert max(sizes) <= reserved
    # Constant once the rings are full, and the encoder's 70-frame windows.
    assert len(set(sizes[72:])) == 1
    pool.close_all()
    assert pool.reserved_bytes == 0


def test_measured_bytes_are_the_bytes_of_the_state_while_rings_share_an_arena(voicechat):
    """A pool sizes its sessions after every step without reading their state (a ring
    in an arena would be sliced to be read); the figure is the state's bytes all the
    same, before the rings fill, while they fill and once they turn."""
    pool = StreamPool(voicechat, max_sessions=2)
    keys = ("one", "two")
    for key in keys:
        pool.open(key, ConversationOptions(context_seconds=WINDOW))
    signal = question_signal(2.0)
    for i in range(30):
        start = (i * FRAME) % (len(signal) - FRAME)
        assert not pool.step({k: signal[start : start + FRAME] for k in keys}).errors
        arenas = pool.batch.timeline.arenas is not None
        measured = [pool.nbytes(k) for k in keys]  # from the rows, none taken out
        assert pool.state_bytes == sum(measured)
        for key, nbytes in zip(keys, measured):  # each one's own state, read alone
            assert nbytes == sum(a.nbytes for a in pool.extract(key).core.compute.state)
    assert arenas  # the rings were in arenas while measured
    pool.close_all()


def test_admission_and_the_pool_keep_one_ledger(voicechat):
    from mlx_voicechat_plugin.runtime.ledger import ReservationLedger
    from mlx_voicechat_plugin.server.engine.admission import Admission

    class Refused:
        count = 0

        def inc(self) -> None:
            self.count += 1

    options = ConversationOptions(context_seconds=WINDOW)
    ledger = ReservationLedger()
    pool = StreamPool(voicechat, max_sessions=2, max_state_bytes=10**9,
                       default_options=options, ledger=ledger)
    admission, least = Admission(ledger, Refused()), pool.ledger.least
    assert admission.try_reserve("a") and ledger.committed_bytes() == least  # not open yet
    pool.open("a", ConversationOptions(context_seconds=WINDOW, system_prompt="Hi."))
    assert ledger.committed_bytes() == pool.reserved["a"] > least  # its own reservation
    pool.close("a")
    assert ledger.committed_bytes() == least  # the slot is still held
    admission.free("a")
    assert ledger.committed_bytes() == 0 and admission.free_slots() == 2


def test_an_unbounded_session_reserves_its_max_streaming_seconds(voicechat):
    reservations = Reservations(voicechat)
    short = reservations.of(ConversationOptions(context_seconds=0, max_streaming_seconds=10), 0)
    long = reservations.of(ConversationOptions(context_seconds=0, max_streaming_seconds=20), 0)
    per_frame = (long - short) / (10 / voicechat.config.frame_duration)
    assert per_frame == 2 * 2 * 16 * 4 + 2 * 4 * 16 * 4 * 2  # 1 LLM + 1 global TTS layer (tiny)
    with pytest.raises(ValueError, match="max_streaming_seconds"):
        reservations.of(ConversationOptions(context_seconds=0), 0)


def test_the_pool_refuses_what_its_reservations_do_not_fit(voicechat):
    one = Reservations(voicechat).of(ConversationOptions(context_seconds=WINDOW), 0)
    pool = StreamPool(voicechat, max_sessions=8, max_state_bytes=2 * one,
                       default_options=ConversationOptions(context_seconds=WINDOW))
    assert pool.ledger.least == one
    pool.open("a", ConversationOptions(context_seconds=WINDOW))
    with pytest.raises(PoolFull, match="--max-state-bytes"):  # its prompt needs more
        pool.open("big", ConversationOptions(context_seconds=WINDOW, system_prompt="A longer prompt."))
    assert "big" not in pool and pool.reserved_bytes == one
    pool.open("b", ConversationOptions(context_seconds=WINDOW))
    with pytest.raises(PoolFull, match="--max-state-bytes"):
        pool.open("c", ConversationOptions(context_seconds=WINDOW))
    pool.close("a")
    pool.open("c", ConversationOptions(context_seconds=WINDOW))
    pool.close_all()


N = 2


@pytest.fixture(scope="module")
def budget_server(tiny_ckpt, voicechat):
    limits = ServerLimits(update_timeout=5, idle_timeout=10, max_sessions=8,
                          context_seconds=WINDOW, max_state_bytes=1)
    one = Reservations(voicechat).of(session_options(limits, {}), 0)
    limits = ServerLimits(update_timeout=5, idle_timeout=10, max_sessions=8,
                          context_seconds=WINDOW, max_state_bytes=N * one)
    live = LiveServer(create_app(tiny_ckpt, limits=limits))
    live.one = one
    yield from running(live)


def _metric(server, name: str) -> float:
    import httpx

    text = httpx.get(server.http("/metrics")).text
    return float(next(l for l in text.splitlines() if l.startswith(name + " ")).split()[-1])


def _frames_total(server) -> float:
    return _metric(server, "voicechat_frames_total")


def test_a_server_admits_n_reservations_and_stays_within_its_budget(budget_server):
    import httpx

    server = budget_server
    server.wait_idle()
    budget = server.health().json()["max_state_bytes"]
    with ExitStack() as stack:
        clients = [stack.enter_context(connect(server.ws())) for _ in range(N)]
        for ws in clients:
            configure(ws, seed=0)
        with connect(server.ws()) as extra:
            expect_error(extra, "server_busy")
        frames = 30  # past the 12-frame window
        before = _frames_total(server)
        signal = question_signal(2.0)
        for i in range(frames):
            start = (i * FRAME) % (len(signal) - FRAME)
            for ws in clients:
                send(ws, append_message(signal[start : start + FRAME]))
        deadline = time.monotonic() + 60
        while _frames_total(server) - before < N * frames:
            assert time.monotonic() < deadline, "frames did not run"
            time.sleep(0.05)
        health = server.health().json()
        assert health["reserved_state_bytes"] == N * server.one == budget
        assert 0 < health["state_bytes"] <= budget
        text = httpx.get(server.http("/metrics")).text
        assert f"voicechat_session_reserved_bytes {float(budget)}" in text
        for ws in clients:
            send(ws, {"type": "input_audio_buffer.commit"})
            until_closed(ws)
    server.wait_idle()
    assert server.health().json()["reserved_state_bytes"] == 0


def test_a_session_whose_prompt_does_not_fit_what_is_left_is_refused_at_open(budget_server):
    server = budget_server
    server.wait_idle()
    with connect(server.ws()) as first, connect(server.ws()) as second:
        configure(first, seed=0)  # reserves the least
        assert recv(second)["type"] == "session.created"  # admitted at accept: the least fits
        refused = _metric(server, "voicechat_admissions_refused_total")
        send(second, {"type": "session.update",
                      "session": {"system_prompt": "Answer in one short sentence, please."}})
        event = expect_error(second, "server_busy")
        assert "--max-state-bytes" in event["error"]["message"]
        assert _metric(server, "voicechat_admissions_refused_total") == refused + 1
        assert server.health().json()["reserved_state_bytes"] == server.one
        send(first, {"type": "session.cancel"})
        until_closed(first)
    server.wait_idle()


def test_a_client_asks_for_a_shorter_context_and_a_bad_one_is_named(budget_server):
    server = budget_server
    server.wait_idle()
    with connect(server.ws()) as ws:
        configure(ws, context_seconds=0.4)  # shorter than the server's: a smaller ring
        assert server.health().json()["reserved_state_bytes"] < server.one
        send(ws, {"type": "session.cancel"})
        until_closed(ws)
    server.wait_idle()
    with connect(server.ws()) as ws:
        assert recv(ws)["type"] == "session.created"
        send(ws, {"type": "session.update", "session": {"context_seconds": -1}})
        event = expect_error(ws, "session_initialization_failed")
        assert "session.context_seconds" in event["error"]["message"]
    server.wait_idle()


def test_the_ga_session_carries_context_seconds_within_the_servers_bound():
    from mlx_voicechat_plugin.server.dialects.ga.dialect import FIELDS
    from mlx_voicechat_plugin.server.dialects.ga.config import GAConfig, merge_session

    limits = ServerLimits(context_seconds=60)
    config = merge_session(GAConfig(), {"context_seconds": 30})
    options = session_options(limits, FIELDS, context_seconds=config.context_seconds)
    assert options.context_seconds == 30
    longer = session_options(limits, FIELDS, context_seconds=600)
    unset = session_options(limits, FIELDS, context_seconds=merge_session(GAConfig(), {}).context_seconds)
    assert longer.context_seconds == unset.context_seconds == 60
    with pytest.raises(Exception, match="session.context_seconds"):
        session_options(limits, FIELDS, context_seconds="long")


def test_a_detached_sessions_state_bytes_are_the_newcomers_at_once(budget_server,
                                                                   monkeypatch):
    """The budget full, a client that drops (no close) leaves its session detached,
    holding its reservation; a newcomer takes its slot and its bytes at once, though the
    engine thread, busy, has not closed the detached session yet: admitted, and its
    session opens (the detached one's close runs first)."""
    from raw_client import RawClient
    from resume_support import abort, event, metric, until

    server = budget_server
    server.wait_idle()
    pool = server.app.state.engine.pool
    close = pool.close

    def busy_close(session_id: str) -> None:  # the engine thread busy (a long step)
        time.sleep(1.0)
        close(session_id)

    monkeypatch.setattr(pool, "close", busy_close)
    with connect(server.ws()) as held:
        configure(held, seed=0)
        dropped = RawClient(server.port, "/v1/realtime")
        assert event(dropped)["type"] == "session.created"
        dropped.send_json({"type": "session.update", "session": {"seed": 0}})
        while (got := event(dropped))["type"] != "session.updated":
            assert got["type"] != "error", got
        assert server.health().json()["reserved_state_bytes"] == N * server.one
        abort(dropped)
        until(lambda: metric(server, "voicechat_detached_sessions") == 1, "the detach")
        assert server.health().json()["free"] == 1  # its slot and its bytes count as free
        reclaimed = metric(server, "voicechat_sessions_reclaimed_total")
        with connect(server.ws()) as newcomer:
            configure(newcomer, seed=0)  # not server_busy, at accept nor at open
            assert metric(server, "voicechat_sessions_reclaimed_total") == reclaimed + 1
            assert server.health().json()["reserved_state_bytes"] == N * server.one
            send(newcomer, {"type": "session.cancel"})
            until_closed(newcomer)
        send(held, {"type": "session.cancel"})
        until_closed(held)
    server.wait_idle()
    assert server.health().json()["reserved_state_bytes"] == 0
