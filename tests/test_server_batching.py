"""Clients that do not wait for each frame: any pacing gives each session its solo output,
a flooding client is held by a bounded buffer, and the warm-up traces every batch size."""

from __future__ import annotations

import logging
import random
import threading
import time

import httpx
import numpy as np
import pytest
from server_support import (
    FRAME,
    LiveServer,
    append_message,
    as_received,
    configure,
    connect,
    running,
    send,
    until_closed,
)

from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.engine import Engine
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal

CLIENTS = 3
BUFFERED_SECONDS = 0.32  # four frames


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    limits = ServerLimits(update_timeout=10, idle_timeout=10, max_sessions=CLIENTS,
                          max_buffered_seconds=BUFFERED_SECONDS)
    yield from running(LiveServer(create_app(tiny_ckpt, limits=limits)))


def _wire(events: list[dict]) -> dict:
    return {
        "text": [e["delta"] for e in events if e["type"] == "response.text.delta"],
        "transcript": "".join(e["delta"] for e in events
                              if e["type"].endswith("input_audio_transcription.delta")),
        "audio": [(e["frame_index"], e["delta"]) for e in events
                  if e["type"] == "response.audio.delta"],
        "errors": [e for e in events if e["type"] == "error"],
        "last": events[-1]["type"] if events else None,
    }


def _stream(server, audio: np.ndarray, seed: int, chunks: list[tuple[int, float]]) -> dict:
    """Send ``audio`` in ``(size, pause before)`` pieces without reading, commit, read all."""
    with connect(server.ws()) as ws:
        configure(ws, seed=seed)
        start = 0
        for size, pause in chunks:
            if pause:
                time.sleep(pause)
            send(ws, append_message(audio[start : start + size]))
            start += size
        assert start == len(audio)
        send(ws, {"type": "input_audio_buffer.commit"})
        events, code = until_closed(ws)
        assert code == 1000
    return _wire(events)


def _frames(audio: np.ndarray) -> list[tuple[int, float]]:
    return [(min(FRAME, len(audio) - s), 0.0) for s in range(0, len(audio), FRAME)]


def _random_pacing(audio: np.ndarray, rng: random.Random) -> list[tuple[int, float]]:
    """Random chunk sizes (a sample to three frames), pauses and bursts."""
    chunks, start = [], 0
    while start < len(audio):
        size = min(rng.choice([1, 7, 333, FRAME - 1, FRAME, FRAME + 5, 3 * FRAME,
                               rng.randint(1, 3 * FRAME)]), len(audio) - start)
        pause = rng.choice([0.0, 0.0, 0.0, 0.005, 0.03, 0.12])  # zeros: a burst
        chunks.append((size, pause))
        start += size
    return chunks


def test_randomly_paced_clients_each_stream_what_they_stream_alone(server):
    server.wait_idle()
    audio = [as_received(question_signal(1.2 + 0.3 * i, seed=i)) for i in range(CLIENTS)]
    alone = [_stream(server, a, i, _frames(a)) for i, a in enumerate(audio)]
    assert all(not a["errors"] and a["audio"] and a["last"] == "response.done" for a in alone)
    for round_ in range(2):
        results: dict[int, dict] = {}

        def run(i: int) -> None:
            rng = random.Random(100 * round_ + i)
            results[i] = _stream(server, audio[i], i, _random_pacing(audio[i], rng))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert [results[i] for i in range(CLIENTS)] == alone, f"round {round_}"


def test_a_flooding_client_is_held_by_a_bounded_buffer_and_still_gets_every_frame(server):
    server.wait_idle()
    engine = server.app.state.engine
    audio = as_received(question_signal(4.0, seed=7))  # 50 frames, sent at once
    alone = _stream(server, audio, 7, [(len(audio), 0.0)])
    engine.input_peak_bytes = 0
    flooded = _stream(server, audio, 7, _frames(audio))
    bound = int(BUFFERED_SECONDS * 16_000) * 4  # float32 samples
    assert flooded == alone
    assert engine.input_peak_bytes <= bound  # never more than the bound waited in memory
    # ... and the client did get that far ahead: the bound, not the engine, held it.
    assert engine.input_peak_bytes >= bound - FRAME * 4


def test_metrics_report_the_collection_wait_of_every_step(server):
    server.wait_idle()

    def count(name: str) -> float:
        text = httpx.get(server.http("/metrics")).text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith(name + " ")))

    steps, waits = count("voicechat_step_batch_size_count"), \
        count("voicechat_batch_wait_seconds_count")
    _stream(server, np.zeros(5 * FRAME, np.float32), 0, _frames(np.zeros(5 * FRAME)))
    assert count("voicechat_batch_wait_seconds_count") - waits == 5
    assert count("voicechat_step_batch_size_count") - steps == 5


def test_the_warm_up_steps_every_batch_size_up_to_max_sessions(tiny_ckpt, monkeypatch, caplog):
    from mlx_voicechat_plugin.runtime.pool import StreamPool

    sizes: set[int] = set()
    step = StreamPool.step

    def counting(self, frames):
        sizes.add(len(frames))
        return step(self, frames)

    monkeypatch.setattr(StreamPool, "step", counting)
    engine = Engine(str(tiny_ckpt), warm_up=True, max_sessions=3)
    with caplog.at_level(logging.INFO, logger="mlx_voicechat_plugin.server.engine.warm_up"):
        engine.start()
        try:
            assert engine.loaded.wait(300) and engine.ready
        finally:
            engine.stop()
    assert sizes == {1, 2, 3}
    assert engine.warm_batch_sizes == (1, 2, 3)
    lines = [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()]
    assert lines[0].startswith("warm-up: compiling batch sizes 1-3")  # it says so first
    lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith("warm-up: batch sizes 1-3 compiled in")
    # The scheduler's first step costs (its filling rule reads them) come from the warm-up.
    assert sorted(engine.step_costs.by_size) == [1, 2, 3]
    assert all(seconds > 0 for seconds in engine.step_costs.by_size.values())
    assert "steps of 1: " in lines[0]


@pytest.mark.parametrize("bad", [dict(max_buffered_seconds=0), dict(max_buffered_seconds=True),
                                 dict(batch_wait_ms=-1), dict(batch_wait_ms=float("nan"))])
def test_the_buffer_bound_and_the_collection_deadline_are_validated(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        ServerLimits(**bad)


def test_serve_has_the_flags_with_their_defaults():
    from mlx_voicechat_plugin.cli.serve import parse

    args = parse(["-m", "ckpt", "--max-buffered-seconds", "0.5", "--batch-wait-ms", "0"],
                 "serve", False)
    assert args.limits.max_buffered_seconds == 0.5 and args.limits.batch_wait_ms == 0
    defaults = parse(["-m", "ckpt"], "serve", False).limits
    assert defaults.max_buffered_seconds == 2.0 and defaults.batch_wait_ms == 30.0
