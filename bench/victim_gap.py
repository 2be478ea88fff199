"""A victim session's audio gaps while other clients send 1 MiB messages (issue 63).

    python -m bench.victim_gap [--window-seconds 4] [--rounds 3] [--checkout DIR] [--json PATH]

Starts ``mlx-voicechat serve`` on the tiny fixture (127.0.0.1, ``--api-key``,
``--no-compile``) and opens a victim realtime session (``/v1/realtime``) that
streams 80 ms frames paced in real time (:func:`bench.load.run_stream`). While
it streams, windows of ``--window-seconds`` run in turn: a quiet one (no
attacker sending), then each attack followed by a quiet one. An attack is one
or more attacker connections on the GA route, each in its own process, sending
``conversation.item.create`` messages of about 340,000 empty objects (just
under the 1 MiB message limit; ~1 KiB on the wire with permessage-deflate) in
a loop, each waiting for its answer (``--attacks``): with the server's key
(``plain``, then ``deflate``), with an ephemeral key minted from it
(``ephemeral``, deflate), then ``all`` three at once. Each attacker's first
message (the server's first parse of one) is sent before the windows. An
attack's window ends once its attackers' last messages are answered; the
``--settle-seconds`` after it count in no window.

Per window it prints the victim's largest and p99 gap between consecutive
audio deltas (by the later delta's arrival), its largest and p99 lateness
against the real-time schedule (bench.load's: frame ``k``'s audio is due when
frame ``k + 1`` has been sent), the attackers' messages, and the longest
``/health`` round trip of a probe polling every 50 ms: how long the server's
loop left a request waiting (the server exposes no loop figure of its own).
Then what each attack adds to the victim's worst gap in a window, over the
quiet windows': the least-disturbed attack window's over the least-disturbed
quiet window's (on a shared machine a window's worst gap is mostly the
machine's; tests/test_server_hostile_bytes.py bounds this one by 200 ms), the
median's over the median, the worst over the quiet median. ``--checkout DIR``
serves another checkout of the package (e.g. a ``git worktree`` of the base
revision) to this same client. A benchmark script, never a timed test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench import check_output
from bench.load import FRAME_SECONDS, Start, run_stream

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "bench-key"
GA = "/openai/v1/realtime"
EMPTIES = 340_000  # empty objects in a message just under the 1 MiB limit
# Attacks: (key, compression) of each attacker connection; "ephemeral" is a key
# minted from the server's (POST .../client_secrets).
ATTACKS: dict[str, list[tuple[str, str | None]]] = {
    "plain": [("server", None)],
    "deflate": [("server", "deflate")],
    "ephemeral": [("ephemeral", "deflate")],
    "all": [("server", None), ("server", "deflate"), ("ephemeral", "deflate")],
}
QUIET = "quiet"
FLOOD_ID = "item_flood"


def flood_message() -> str:
    """A ``conversation.item.create`` of ~340,000 empty objects (1 MiB less ~40 KiB)."""
    return ('{"type":"conversation.item.create","item":{"id":"%s","type":"message",'
            '"role":"user","content":[%s]}}' % (FLOOD_ID, ",".join(["{}"] * EMPTIES)))


def attack(url: str, key: str, compression: str | None, interval: float = 0.0) -> None:
    """An attacker process's body: connect, say ``ready``, then between ``go`` and
    ``stop`` on stdin send :func:`flood_message` in a loop, each answered (an error,
    or the item done and then deleted: the next has its id); after ``stop`` say
    ``stopped N`` (N: the messages answered since ``go``). ``once`` sends one and says
    ``stopped 1``. A message starts ``interval`` seconds after the one before at the
    soonest (0: as soon as it is answered). Stdin's end closes the connection."""
    from websockets.sync.client import connect

    go, once, done = threading.Event(), threading.Event(), threading.Event()

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() in ("go", "once"):
                (once.set if line.strip() == "once" else once.clear)()
                go.set()
            elif line.strip() == "stop":
                go.clear()
        done.set()
        go.set()

    def answered(ws: Any, *kinds: str) -> str:
        while True:
            kind = json.loads(ws.recv(timeout=300))["type"]
            if kind in kinds:
                return kind

    with connect(url, additional_headers={"Authorization": f"Bearer {key}"}, max_size=None,
                 compression=compression, open_timeout=60) as ws:
        answered(ws, "session.created")
        ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
        answered(ws, "session.updated")  # a configured session: no update deadline
        message = flood_message()  # built once: the attacker's own CPU is not the measure
        print("ready", flush=True)
        threading.Thread(target=commands, daemon=True).start()
        while True:
            go.wait()
            if done.is_set():
                return
            sent = 0
            while go.is_set() and not done.is_set():
                began = time.perf_counter()
                ws.send(message)
                if answered(ws, "conversation.item.done", "error") != "error":
                    ws.send(json.dumps({"type": "conversation.item.delete",
                                        "item_id": FLOOD_ID}))
                    answered(ws, "conversation.item.deleted")
                sent += 1
                if once.is_set():
                    go.clear()
                time.sleep(max(began + interval - time.perf_counter(), 0.0))
            print(f"stopped {sent}", flush=True)


class Attacker:
    """One attacker connection in its own process (its parsing and sending are not the
    victim client's), driven by :meth:`go` and :meth:`stop`."""

    def __init__(self, url: str, key: str, compression: str | None, interval: float = 0.0):
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from bench.victim_gap import attack; "
             "attack(sys.argv[1], sys.argv[2], sys.argv[3] or None, float(sys.argv[4]))",
             url, key, compression or "", str(interval)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, word: str) -> str:
        line = self.process.stdout.readline()
        if not line.startswith(word):
            self.close()
            raise RuntimeError(f"attacker said {line!r}, not {word!r} "
                               f"(exit {self.process.poll()})")
        return line

    def _say(self, word: str) -> None:
        self.process.stdin.write(word + "\n")
        self.process.stdin.flush()

    def go(self) -> None:
        self._say("go")

    def once(self) -> int:
        """One message, answered (the server's first parse of one is not the steady one)."""
        self._say("once")
        return self.stopped()

    def stop(self) -> None:
        self._say("stop")

    def stopped(self) -> int:
        """Messages answered since :meth:`go`, once the last is."""
        return int(self._expect("stopped").split()[1])

    def close(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def mint(http: str) -> str:
    """An ephemeral key minted with the server's key."""
    import httpx

    answer = httpx.post(http + GA + "/client_secrets", json={}, timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"})
    answer.raise_for_status()
    return answer.json()["value"]


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds (NaN where there is no ``/proc``)."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Window:
    name: str
    start: float = float("nan")
    end: float = float("nan")
    messages: int = 0
    server_cpu_s: float = float("nan")  # the server process's CPU time in the window


@dataclass
class Probe:
    """``GET /health`` every ``every`` seconds until stopped: (sent, round trip) pairs."""

    url: str
    every: float = 0.05
    trips: list[tuple[float, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=60) as client:
            while not self._stop.wait(self.every):
                began = time.perf_counter()
                try:
                    client.get(self.url)
                except httpx.HTTPError:
                    continue
                self.trips.append((began, time.perf_counter() - began))

    def __enter__(self) -> "Probe":
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(70)


def run_windows(ws_url: str, headers: dict[str, str], plan: Sequence[tuple[str, list]],
                window_s: float, settle_s: float = 0.5, warmup_s: float = 1.5,
                audio_s: float = 600.0, server_pid: int | None = None
                ) -> tuple[list[Window], Any]:
    """Stream the victim and run ``plan`` (a window's name and its attackers, none: a
    quiet window) in order; the windows and the victim's figures
    (:class:`bench.load.StreamFigures`, with each audio delta's arrival)."""
    from mlx_voicechat_plugin.testing.fixtures import question_signal

    cpu = (lambda: cpu_seconds(server_pid)) if server_pid else (lambda: float("nan"))
    audio = question_signal(audio_s, seed=7)
    until, start, figures = threading.Event(), Start(1), []
    victim = threading.Thread(target=lambda: figures.append(
        run_stream(ws_url, audio, headers, start, 0.0, "paced", until=until)), daemon=True)
    victim.start()
    windows: list[Window] = []
    try:
        while not start.at and victim.is_alive():
            time.sleep(0.01)
        for attacker in {id(a): a for _, attackers in plan for a in attackers}.values():
            attacker.once()
        time.sleep(warmup_s)
        for name, attackers in plan:
            if not victim.is_alive():
                break
            window = Window(name, start=time.perf_counter())
            cpu_before = cpu()
            for attacker in attackers:
                attacker.go()
            time.sleep(window_s)
            for attacker in attackers:
                attacker.stop()
            window.messages = sum(attacker.stopped() for attacker in attackers)
            window.end = time.perf_counter()
            window.server_cpu_s = cpu() - cpu_before
            windows.append(window)
            if attackers:
                time.sleep(settle_s)
    finally:
        until.set()
        victim.join(600)
    if not figures or figures[0].error:
        raise RuntimeError(f"the victim failed: {figures[0].error if figures else 'no figures'}")
    return windows, figures[0]


def window_figures(window: Window, victim: Any,
                   trips: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """The victim's gaps and lateness, and the probe's round trips, inside ``window``."""
    inside = lambda t: window.start <= t < window.end  # noqa: E731
    arrivals = victim.arrivals
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if inside(b)]
    late = [x for t, x in zip(arrivals, victim.lateness_s) if inside(t)]
    health = [rtt for t, rtt in trips if inside(t)]

    def top(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    return {"window": window.name, "seconds": window.end - window.start,
            "deltas": len(gaps), "messages": window.messages,
            "server_cpu_per_s": window.server_cpu_s / (window.end - window.start),
            "gap_max_ms": 1000 * top(gaps, 100), "gap_p99_ms": 1000 * top(gaps, 99),
            "late_max_ms": 1000 * top(late, 100), "late_p99_ms": 1000 * top(late, 99),
            "health_max_ms": 1000 * top(health, 100)}


def added_to_worst_gap(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """What each attack adds to the victim's worst gap in a window (ms), over the quiet
    windows': the least-disturbed window's over theirs (what the server adds, where
    the machine added least), the median window's, and its worst window's over their
    median (on a shared machine a window's largest gap is mostly the machine's)."""
    quiet = [r["gap_max_ms"] for r in rows if r["window"] == QUIET]
    worst: dict[str, list[float]] = {}
    for row in rows:
        if row["window"] != QUIET:
            worst.setdefault(row["window"], []).append(row["gap_max_ms"])
    return {name: {"least": min(values) - min(quiet),
                   "median": statistics.median(values) - statistics.median(quiet),
                   "worst": max(values) - statistics.median(quiet)}
            for name, values in worst.items()}


def describe(row: dict[str, Any]) -> str:
    return (f"{row['window']:>9}: gap max/p99 {row['gap_max_ms']:7.1f}/"
            f"{row['gap_p99_ms']:6.1f} ms, "
            f"lateness max/p99 {row['late_max_ms']:7.1f}/{row['late_p99_ms']:6.1f} ms, "
            f"/health max {row['health_max_ms']:7.1f} ms, {row['deltas']} deltas in "
            f"{row['seconds']:.1f} s, {row['messages']} attack messages, server CPU "
            f"{row['server_cpu_per_s']:.2f} s/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.victim_gap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-seconds", type=float, default=4.0,
                        help="each window's length (default %(default)s)")
    parser.add_argument("--settle-seconds", type=float, default=0.5,
                        help="after an attack, time that counts in no window (default "
                             "%(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every attack (and the quiet window after it) runs "
                             "(default %(default)s)")
    parser.add_argument("--attacks", nargs="+", choices=list(ATTACKS), default=list(ATTACKS))
    parser.add_argument("--interval", type=float, default=0.0,
                        help="an attacker's messages start this many seconds apart at the "
                             "soonest (default 0: each as soon as the last is answered)")
    parser.add_argument("--checkout", default=None,
                        help="serve this checkout of the package (its root: PYTHONPATH) "
                             "instead of this one")
    parser.add_argument("--json", default=None, help="write every window's figures here")
    args = parser.parse_args(argv)
    if args.window_seconds <= 0 or min(args.settle_seconds, args.interval) < 0 \
            or args.rounds < 1:
        parser.error("--window-seconds must be > 0, --settle-seconds and --interval >= 0, "
                     "--rounds >= 1")
    check_output(parser, args.json, "--json")
    sys.path.insert(0, str(ROOT / "tests"))
    from server_support import ServerProcess

    from mlx_voicechat_plugin.testing.fixtures import make_checkpoint

    kinds = list(dict.fromkeys(kind for name in args.attacks for kind in ATTACKS[name]))
    env = {"PYTHONPATH": str(Path(args.checkout).resolve())} if args.checkout else None
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "tiny", "tiny")
        server = ServerProcess(
            "mlx_voicechat_plugin.cli.main",
            ["serve", "-m", str(ckpt), "--no-compile", "--api-key", API_KEY,
             "--log-level", "warning", "--max-sessions", str(1 + len(kinds))],
            Path(tmp) / "serve.log", env=env)
        attackers: dict[tuple[str, str | None], Attacker] = {}
        try:
            keys = {"server": API_KEY, "ephemeral": mint(server.http(""))}
            for kind in kinds:
                attackers[kind] = Attacker(server.ws(GA), keys[kind[0]], kind[1],
                                           args.interval)
            plan = [(QUIET, [])] + [
                step for _ in range(args.rounds) for name in args.attacks
                for step in ((name, [attackers[k] for k in ATTACKS[name]]), (QUIET, []))]
            headers = {"Authorization": f"Bearer {API_KEY}"}
            with Probe(server.http("/health")) as probe:
                windows, victim = run_windows(server.ws("/v1/realtime"), headers, plan,
                                              args.window_seconds, args.settle_seconds,
                                              server_pid=server.process.pid)
        finally:
            for attacker in attackers.values():
                attacker.close()
            server.stop()
    rows = [window_figures(w, victim, probe.trips) for w in windows]
    print(f"victim: {len(victim.arrivals)} audio deltas for {victim.frames_sent} frames of "
          f"{1000 * FRAME_SECONDS:.0f} ms ({victim.drops} drops)")
    for row in rows:
        print(describe(row), flush=True)
    added = added_to_worst_gap(rows)
    for name, ms in added.items():
        print(f"{name}: adds to the victim's worst gap in a window, over the quiet windows' "
              f"{ms['least']:+.1f} ms least-disturbed window, {ms['median']:+.1f} ms median, "
              f"{ms['worst']:+.1f} ms worst (over their median)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"windows": rows, "added_to_worst_gap_ms": added}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
