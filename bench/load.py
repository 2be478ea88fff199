"""Load client: N real-time-paced realtime streams against a running server.

``python -m bench.load --url ws://HOST:PORT/v1/realtime --num-streams N --seconds S WAV``

Each stream connects, configures, then sends the WAV (16 kHz mono, looped or
cut to ``--seconds``) one 80 ms frame every 80 ms of wall time, commits and
reads until the server closes. Per stream it measures the time to
``session.updated``, the first-audio latency (first append to first
``response.audio.delta``), each audio delta's lateness against the real-time
schedule (frame ``k``'s audio is due when frame ``k + 1``'s input has been
sent: the codec releases a frame's audio one frame later) and drops (frames
sent without an audio delta back). It runs N = 1, 2, 4, ... up to
``--num-streams`` and prints the largest N whose p95 lateness stays under
``--late-ms`` with no drops and no refusals: size ``--max-sessions`` by that,
not by what fits in memory.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FRAME_SECONDS = 0.08
RATE = 16_000
FRAME = int(RATE * FRAME_SECONDS)


@dataclass
class StreamFigures:
    updated_s: float = float("nan")
    first_audio_s: float = float("nan")
    lateness_s: list[float] = field(default_factory=list)
    frames_sent: int = 0
    audio_frames: int = 0
    error: str | None = None

    @property
    def drops(self) -> int:
        return max(self.frames_sent - self.audio_frames, 0)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


def _pcm16_b64(samples: np.ndarray) -> str:
    pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2").tobytes()
    return base64.b64encode(pcm).decode("ascii")


def run_stream(url: str, audio: np.ndarray, headers: dict[str, str], start: threading.Barrier
               ) -> StreamFigures:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    figures = StreamFigures()
    frames = [audio[i : i + FRAME] for i in range(0, len(audio) - FRAME + 1, FRAME)]
    start.wait(30)
    began = time.perf_counter()
    try:
        with connect(url, max_size=None, open_timeout=30, additional_headers=headers) as ws:
            created = json.loads(ws.recv(timeout=30))
            if created.get("type") != "session.created":
                figures.error = created.get("error", {}).get("code", str(created)[:80])
                return figures
            ws.send(json.dumps({"type": "session.update", "session": {}}))
            received: list[tuple[float, dict]] = []

            def reader() -> None:
                try:
                    while True:
                        received.append((time.perf_counter(), json.loads(ws.recv())))
                except ConnectionClosed:
                    pass

            while True:  # session.updated first
                event = json.loads(ws.recv(timeout=120))
                if event["type"] == "session.updated":
                    break
                if event["type"] == "error":
                    figures.error = event["error"]["code"]
                    return figures
            figures.updated_s = time.perf_counter() - began
            thread = threading.Thread(target=reader, daemon=True)
            thread.start()
            t0 = time.perf_counter()
            for k, frame in enumerate(frames):
                delay = t0 + k * FRAME_SECONDS - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                ws.send(json.dumps({"type": "input_audio_buffer.append",
                                    "audio": _pcm16_b64(frame)}))
                figures.frames_sent += 1
            ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            thread.join(300)
    except Exception as exc:  # a refused or broken stream is a figure too
        figures.error = f"{type(exc).__name__}: {exc}"[:120]
        return figures
    audio_events = [(t, e) for t, e in received if e.get("type") == "response.audio.delta"]
    figures.audio_frames = len(audio_events)
    if audio_events:
        figures.first_audio_s = audio_events[0][0] - t0
    for k, (arrived, _) in enumerate(audio_events[: figures.frames_sent]):
        due = t0 + (k + 2) * FRAME_SECONDS  # frame k + 1's input fully sent
        figures.lateness_s.append(max(arrived - due, 0.0))
    return figures


def run_level(url: str, audio: np.ndarray, streams: int, headers: dict[str, str]) -> dict:
    barrier = threading.Barrier(streams)
    results: list[StreamFigures] = [StreamFigures() for _ in range(streams)]

    def one(i: int) -> None:
        results[i] = run_stream(url, audio, headers, barrier)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    late = [x for r in results for x in r.lateness_s]
    ok = [r for r in results if r.error is None]
    return {
        "streams": streams,
        "errors": [r.error for r in results if r.error is not None],
        "updated_s_p50": _percentile([r.updated_s for r in ok], 50),
        "first_audio_s_p50": _percentile([r.first_audio_s for r in ok], 50),
        "lateness_s_p50": _percentile(late, 50),
        "lateness_s_p95": _percentile(late, 95),
        "drops": sum(r.drops for r in ok),
    }


def load_audio(path: str, seconds: float) -> np.ndarray:
    from mlx_voicechat_plugin.runtime.audio import load_waveform

    waveform = np.array(load_waveform(path, RATE), dtype=np.float32)
    want = int(seconds * RATE)
    if waveform.shape[0] == 0:
        raise SystemExit(f"{path}: no samples")
    reps = -(-want // waveform.shape[0])
    return np.tile(waveform, reps)[:want]


def levels(maximum: int) -> list[int]:
    out, n = [], 1
    while n < maximum:
        out.append(n)
        n *= 2
    return out + [maximum]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wav")
    parser.add_argument("--url", default="ws://127.0.0.1:8080/v1/realtime")
    parser.add_argument("--num-streams", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--late-ms", type=float, default=160.0,
                        help="p95 lateness a level may have and still count as real time")
    parser.add_argument("--json", default=None, help="write every level's figures here")
    args = parser.parse_args(argv)
    if args.num_streams < 1 or args.seconds <= 0:
        parser.error("--num-streams must be >= 1 and --seconds > 0")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    audio = load_audio(args.wav, args.seconds)
    rows: list[dict[str, Any]] = []
    best = 0
    for n in levels(args.num_streams):
        row = run_level(args.url, audio, n, headers)
        rows.append(row)
        real_time = not row["errors"] and not row["drops"] \
            and row["lateness_s_p95"] * 1000 <= args.late_ms
        print(f"N={n:3d}: session.updated p50 {row['updated_s_p50'] * 1000:7.1f} ms, "
              f"first audio p50 {row['first_audio_s_p50'] * 1000:7.1f} ms, lateness p50/p95 "
              f"{row['lateness_s_p50'] * 1000:6.1f}/{row['lateness_s_p95'] * 1000:6.1f} ms, "
              f"drops {row['drops']}, errors {len(row['errors'])}"
              f"{'' if real_time else '  (not real time)'}", flush=True)
        if real_time:
            best = n
        else:
            break
    print(f"largest real-time N: {best}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"levels": rows, "largest_real_time": best}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
