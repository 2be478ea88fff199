"""Load client: N realtime streams against a running server, per N the lateness and batch sizes.

``python -m bench.load --url ws://HOST:PORT/v1/realtime --num-streams N --seconds S WAV``

Each stream connects, configures, then sends the WAV (16 kHz mono, looped or
cut to ``--seconds``) one 80 ms frame a message, commits and reads until the
server closes. Once every stream of a level has its ``session.updated``,
they start together, stream ``i`` offset by ``i / N`` of ``--stagger-ms``
(staggered phases, as independent clients have). ``--mode``:

- ``paced`` (default): one frame every 80 ms of wall time (a microphone);
- ``burst``: ``--burst-frames`` frames at once, every ``--burst-frames`` x 80 ms
  (real time on average, bursty on the wire);
- ``ptt``: push-to-talk, paced, then commit and wait for ``response.done``
  (reports commit-to-done latency);
- ``unpaced``: as fast as the socket takes them (reports aggregate frames/s
  and its gain over the level with one stream, i.e. what batching buys).

Per stream it measures the time to ``session.updated``, the first-audio
latency (first append to first ``response.audio.delta``), each audio delta's
lateness against the real-time schedule (frame ``k``'s audio is due when
frame ``k + 1``'s input has been sent: the codec releases a frame's audio one
frame later) and drops (frames sent without an audio delta back). Per level
it reads the server's ``/metrics`` before and after: the mean step batch size
(frames per step), the steps, and the mean collection wait
(``voicechat_batch_wait_seconds``). It runs N = 1, 2, 4, ... up to
``--num-streams`` (or ``--levels``) and, in the timed modes, prints the
largest N whose p95 lateness stays under ``--late-ms`` with no drops and no
refusals: size ``--max-sessions`` by that, not by what fits in memory.

Pointed at a balancer in front of replicas (``deploy/haproxy.cfg``), the
streams spread over the replicas and the largest real-time N is the whole
deployment's; give every replica's ``/metrics`` (``--metrics-url URL1 URL2
...``) to sum their step figures. A stream the balancer refuses (every
replica full: a 503 after its queue timeout) counts as an error, as a
``server_busy`` does.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Sequence
from urllib.parse import urlsplit, urlunsplit

import numpy as np

FRAME_SECONDS = 0.08
RATE = 16_000
FRAME = int(RATE * FRAME_SECONDS)
MODES = ("paced", "burst", "ptt", "unpaced")
TIMED = ("paced", "burst", "ptt")


@dataclass
class StreamFigures:
    updated_s: float = float("nan")
    first_audio_s: float = float("nan")
    lateness_s: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # each audio delta's (perf_counter)
    frames_sent: int = 0
    audio_frames: int = 0
    commit_to_done_s: float = float("nan")
    started: float = float("nan")  # first append (perf_counter)
    ended: float = float("nan")  # the server's close
    error: str | None = None

    @property
    def drops(self) -> int:
        return max(self.frames_sent - self.audio_frames, 0)


def _percentile(values: list[float], q: float) -> float:
    values = [v for v in values if v == v]
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


def _pcm16_b64(samples: np.ndarray) -> str:
    pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2").tobytes()
    return base64.b64encode(pcm).decode("ascii")


class Start:
    """Every stream of a level waits here once (ready or refused); they share one start time."""

    def __init__(self, streams: int):
        self.at = 0.0
        self.barrier = threading.Barrier(streams, action=self._mark)

    def _mark(self) -> None:
        self.at = time.perf_counter() + 0.05

    def wait(self) -> float:
        try:
            self.barrier.wait(120)
        except threading.BrokenBarrierError:
            self.at = self.at or time.perf_counter()
        return self.at


def send_times(mode: str, frames: int, t0: float, burst: int) -> list[float]:
    """When each frame is sent (``-inf``: at once)."""
    if mode == "unpaced":
        return [float("-inf")] * frames
    if mode == "burst":
        return [t0 + (k // burst) * burst * FRAME_SECONDS for k in range(frames)]
    return [t0 + k * FRAME_SECONDS for k in range(frames)]


def run_stream(url: str, audio: np.ndarray, headers: dict[str, str], start: Start,
               offset_s: float, mode: str = "paced", burst: int = 10,
               until: threading.Event | None = None) -> StreamFigures:
    """One stream's figures; it stops sending early (then commits) once ``until`` is set."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    figures = StreamFigures()
    frames = [audio[i : i + FRAME] for i in range(0, len(audio) - FRAME + 1, FRAME)]
    began = time.perf_counter()
    arrived = False
    received: list[tuple[float, dict]] = []
    try:
        with connect(url, max_size=None, open_timeout=30, additional_headers=headers) as ws:
            created = json.loads(ws.recv(timeout=30))
            if created.get("type") != "session.created":
                figures.error = created.get("error", {}).get("code", str(created)[:80])
                return figures
            ws.send(json.dumps({"type": "session.update", "session": {}}))

            def reader() -> None:
                try:
                    while True:
                        received.append((time.perf_counter(), json.loads(ws.recv())))
                except ConnectionClosed:
                    pass
                figures.ended = time.perf_counter()

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
            arrived = True
            t0 = start.wait() + offset_s
            for k, (frame, when) in enumerate(zip(frames, send_times(mode, len(frames), t0,
                                                                     burst))):
                if until is not None and until.is_set():
                    break
                delay = when - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                ws.send(json.dumps({"type": "input_audio_buffer.append",
                                    "audio": _pcm16_b64(frame)}))
                if k == 0:
                    figures.started = time.perf_counter()
                figures.frames_sent += 1
            committed = time.perf_counter()
            ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            thread.join(600)
    except Exception as exc:  # a refused or broken stream is a figure too
        figures.error = f"{type(exc).__name__}: {exc}"[:120]
        return figures
    finally:
        if not arrived:
            start.wait()
    audio_events = [(t, e) for t, e in received if e.get("type") == "response.audio.delta"]
    figures.audio_frames = len(audio_events)
    figures.arrivals = [t for t, _ in audio_events]
    if audio_events:
        figures.first_audio_s = audio_events[0][0] - figures.started
    done = [t for t, e in received if e.get("type") == "response.done"]
    if done:
        figures.commit_to_done_s = done[0] - committed
    if mode != "unpaced":
        for k, (arrival, _) in enumerate(audio_events[: figures.frames_sent]):
            due = t0 + (k + 2) * FRAME_SECONDS  # frame k + 1's input fully sent
            figures.lateness_s.append(max(arrival - due, 0.0))
    return figures


def metrics_url(ws_url: str) -> str:
    """``/metrics`` of the server behind a realtime URL (same prefix)."""
    parts = urlsplit(ws_url)
    path = parts.path
    for route in ("/openai/v1/realtime", "/v1/realtime"):
        if path.endswith(route):
            path = path[: -len(route)]
            break
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, path + "/metrics", "", ""))


def read_metrics(url: str | Sequence[str] | None, headers: dict[str, str]) -> dict[str, float]:
    """The engine's counters (``name -> value``), summed over ``url`` when it is several
    (each replica behind a balancer); a ``/metrics`` that is unreachable adds nothing."""
    if not url:
        return {}
    values: dict[str, float] = {}
    for one in [url] if isinstance(url, str) else url:
        try:
            with urllib.request.urlopen(urllib.request.Request(one, headers=headers),
                                        timeout=10) as response:
                text = response.read().decode()
        except Exception:
            continue
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.rpartition(" ")
                try:
                    values[name] = values.get(name, 0.0) + float(value)
                except ValueError:
                    pass
    return values


def _delta_ratio(after: dict, before: dict, top: str, bottom: str) -> float:
    count = after.get(bottom, 0.0) - before.get(bottom, 0.0)
    if count <= 0:
        return float("nan")
    return (after.get(top, 0.0) - before.get(top, 0.0)) / count


def run_level(url: str, audio: np.ndarray, streams: int, headers: dict[str, str],
              mode: str = "paced", stagger_s: float = FRAME_SECONDS, burst: int = 10,
              metrics: str | Sequence[str] | None = None) -> dict:
    start = Start(streams)
    results: list[StreamFigures] = [StreamFigures() for _ in range(streams)]

    def one(i: int) -> None:
        results[i] = run_stream(url, audio, headers, start, i * stagger_s / streams, mode, burst)

    before = read_metrics(metrics, headers)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    time.sleep(0.2)  # the last steps' counters
    after = read_metrics(metrics, headers)
    late = [x for r in results for x in r.lateness_s]
    ok = [r for r in results if r.error is None]
    wall = (max(r.ended for r in ok) - min(r.started for r in ok)) if ok else float("nan")
    frames = sum(r.frames_sent for r in ok)
    return {
        "streams": streams,
        "mode": mode,
        "errors": [r.error for r in results if r.error is not None],
        "updated_s_p50": _percentile([r.updated_s for r in ok], 50),
        "first_audio_s_p50": _percentile([r.first_audio_s for r in ok], 50),
        "lateness_s_p50": _percentile(late, 50),
        "lateness_s_p95": _percentile(late, 95),
        "commit_to_done_s_p50": _percentile([r.commit_to_done_s for r in ok], 50),
        "commit_to_done_s_p95": _percentile([r.commit_to_done_s for r in ok], 95),
        "drops": sum(r.drops for r in ok),
        "frames": frames,
        "wall_s": wall,
        "aggregate_fps": frames / wall if wall == wall and wall > 0 else float("nan"),
        "steps": after.get("voicechat_step_batch_size_count", 0.0)
        - before.get("voicechat_step_batch_size_count", 0.0),
        "mean_batch": _delta_ratio(after, before, "voicechat_step_batch_size_sum",
                                   "voicechat_step_batch_size_count"),
        "mean_step_ms": 1000 * _delta_ratio(after, before, "voicechat_step_seconds_sum",
                                            "voicechat_step_seconds_count"),
        "mean_wait_ms": 1000 * _delta_ratio(after, before, "voicechat_batch_wait_seconds_sum",
                                            "voicechat_batch_wait_seconds_count"),
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


def describe(row: dict, gain: float | None) -> str:
    ms = lambda key: row[key] * 1000  # noqa: E731
    text = (f"N={row['streams']:3d}: session.updated p50 {ms('updated_s_p50'):7.1f} ms, "
            f"first audio p50 {ms('first_audio_s_p50'):7.1f} ms, ")
    if row["mode"] == "unpaced":
        text += (f"{row['frames']} frames in {row['wall_s']:.2f} s "
                 f"({row['aggregate_fps']:.1f} f/s"
                 + (f", x{gain:.2f} one stream" if gain is not None else "") + "), ")
    else:
        text += (f"lateness p50/p95 {ms('lateness_s_p50'):6.1f}/{ms('lateness_s_p95'):6.1f} ms, ")
    if row["mode"] == "ptt":
        text += f"commit->done p50/p95 {ms('commit_to_done_s_p50'):.0f}/" \
                f"{ms('commit_to_done_s_p95'):.0f} ms, "
    return text + (f"batch {row['mean_batch']:.2f} ({row['steps']:.0f} steps of "
                   f"{row['mean_step_ms']:.1f} ms, wait {row['mean_wait_ms']:.1f} ms), "
                   f"drops {row['drops']}, "
                   f"errors {len(row['errors'])}")


def gains(rows: list[dict]) -> list[str]:
    """Unpaced: each N's aggregate frames/s over one stream's (medians of the levels run),
    and the first level's alone (a first run after start-up when it ran first)."""
    solo = [r["aggregate_fps"] for r in rows if r["streams"] == 1 and not r["errors"]]
    if not solo:
        return []
    one = float(np.median(solo))
    lines = []
    for n in sorted({r["streams"] for r in rows if r["streams"] > 1}):
        runs = [r["aggregate_fps"] / one for r in rows if r["streams"] == n and not r["errors"]]
        if runs:
            lines.append(f"aggregate gain at N={n}: x{np.median(runs):.2f} one stream "
                         f"(median of {len(runs)}: {', '.join(f'{g:.2f}' for g in runs)})")
    if rows[0]["streams"] > 1 and not rows[0]["errors"]:
        lines.append(f"first level (N={rows[0]['streams']}): "
                     f"x{rows[0]['aggregate_fps'] / one:.2f} one stream")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wav")
    parser.add_argument("--url", default="ws://127.0.0.1:8080/v1/realtime")
    parser.add_argument("--num-streams", type=int, default=4)
    parser.add_argument("--levels", type=int, nargs="+", default=None,
                        help="the N to run, in order (default 1, 2, 4, ... --num-streams); "
                             "e.g. 4 1 4 measures a first run after start-up, then warm")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--mode", choices=MODES, default="paced")
    parser.add_argument("--stagger-ms", type=float, default=1000 * FRAME_SECONDS,
                        help="stream i starts i/N of this after the first (default one frame)")
    parser.add_argument("--burst-frames", type=int, default=10,
                        help="frames sent at once in --mode burst (default %(default)s)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--late-ms", type=float, default=80.0,
                        help="p95 lateness a level may have and still count as real time "
                             "(default %(default)s)")
    parser.add_argument("--metrics-url", nargs="+", action="extend", default=None,
                        help="the server's /metrics (default: derived from --url); behind a "
                             "balancer, every replica's /metrics, whose counters are summed "
                             "(the derived one would be whichever replica the balancer picks)")
    parser.add_argument("--json", default=None, help="write every level's figures here")
    args = parser.parse_args(argv)
    if args.num_streams < 1 or args.seconds <= 0 or args.burst_frames < 1:
        parser.error("--num-streams and --burst-frames must be >= 1 and --seconds > 0")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    audio = load_audio(args.wav, args.seconds)
    metrics = args.metrics_url or metrics_url(args.url)
    rows: list[dict[str, Any]] = []
    best, one = 0, None
    for n in args.levels or levels(args.num_streams):
        row = run_level(args.url, audio, n, headers, args.mode, args.stagger_ms / 1000,
                        args.burst_frames, metrics)
        rows.append(row)
        if n == 1 and one is None and not row["errors"]:
            one = row["aggregate_fps"]
        gain = row["aggregate_fps"] / one if one else None
        row["gain_vs_one"] = gain
        real_time = not row["errors"] and not row["drops"] \
            and row["lateness_s_p95"] * 1000 <= args.late_ms
        print(describe(row, gain) + ("" if real_time or args.mode not in TIMED
                                     else "  (not real time)"), flush=True)
        if args.mode not in TIMED:
            continue
        if real_time:
            best = n
        elif args.levels is None:
            break
    if args.mode in TIMED:
        print(f"largest real-time N: {best}")
    else:
        for line in gains(rows):
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "levels": rows, "largest_real_time": best}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
