"""The wire format, event by event, against the reference server.

    python -m conformance.wire CKPT WAV [--system-prompt S] [--seed N]
        [--extra-decoding-seconds X] [--chunk SAMPLES] [--cancel]

One scripted conversation (ping, ``session.update``, an unsupported message,
PCM16 appends, commit or cancel) runs through the reference's own endpoint
(``mlx_vlm.server.realtime.realtime_voicechat_endpoint`` with its streaming
session and ``_serialize_model_event``, on an in-memory WebSocket) and through
our server (``create_app``, over Starlette's test WebSocket). Our events of
the kinds the reference has are diffed with the reference's, one by one:
type, key set (extra keys allowed, missing ones not), JSON types, and the
values ``frame_index``, ``token_id``, ``delta``, ``text``, ``transcript``,
``audio_codes`` and ``error.code``. Audio bytes: ours must equal the offline
decode of our codes exactly; ours against the reference's is the documented
codec divergence (conformance/README.md, #4), reported on its own line and
not a failure. Exits 1 on any other difference.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Kinds the reference server sends (mlx_vlm/server/realtime.py).
REFERENCE_KINDS = (
    "session.created",
    "session.updated",
    "session.pong",
    "error",
    "input_audio_buffer.committed",
    "conversation.item.input_audio_transcription.delta",
    "response.text.delta",
    "response.function.delta",
    "response.audio.delta",
    "response.done",
    "response.cancelled",
)
VALUE_FIELDS = ("frame_index", "token_id", "text", "transcript", "audio_codes")
UNSUPPORTED = {"type": "conformance.unsupported"}
PCM16_SCALE = 32768.0
MAX_REFERENCE_LAG = 64  # samples searched when aligning the reference's audio


def script(signal: np.ndarray, checkpoint: str, *, system_prompt: str | None, seed: int,
           chunk: int, cancel: bool) -> list[dict[str, Any]]:
    """The client messages, identical for both servers."""
    session: dict[str, Any] = {"model": checkpoint, "seed": seed}
    if system_prompt is not None:
        session["system_prompt"] = system_prompt
    pcm = np.round(np.clip(signal, -1.0, 1.0) * 32767.0).astype("<i2")
    messages: list[dict[str, Any]] = [
        {"type": "session.ping"},
        {"type": "session.update", "session": session},
        UNSUPPORTED,
    ]
    for start in range(0, len(pcm), chunk):
        audio = base64.b64encode(pcm[start : start + chunk].tobytes()).decode("ascii")
        messages.append({"type": "input_audio_buffer.append", "audio": audio,
                         "sample_rate": 16_000})
    messages.append({"type": "session.cancel" if cancel else "input_audio_buffer.commit"})
    return messages


# --- the two servers ------------------------------------------------------


class _ScriptedSocket:
    """The part of Starlette's WebSocket the reference endpoint uses."""

    def __init__(self, messages: list[dict[str, Any]]):
        self._messages = list(messages)
        self.sent: list[dict[str, Any]] = []
        self.query_params: dict[str, str] = {}
        self.close_code: int | None = None

    async def accept(self) -> None:
        pass

    async def send_json(self, payload: dict[str, Any]) -> None:
        self.sent.append(json.loads(json.dumps(payload)))  # as a client would parse it

    async def receive_json(self) -> dict[str, Any]:
        from starlette.websockets import WebSocketDisconnect

        if not self._messages:
            raise WebSocketDisconnect(1000)
        return self._messages.pop(0)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.close_code = code


def reference_events(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from mlx_vlm.server.realtime import realtime_voicechat_endpoint

    socket = _ScriptedSocket(messages)
    asyncio.run(realtime_voicechat_endpoint(socket))
    return socket.sent


def our_events(checkpoint: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our server's events for ``messages``."""
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from mlx_voicechat_plugin.server.app import create_app

    app = create_app(checkpoint)
    events: list[dict[str, Any]] = []
    with TestClient(app) as client:
        engine = app.state.engine
        deadline = time.monotonic() + 600
        while not engine.loaded.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        if engine.load_error is not None:
            raise engine.load_error
        with client.websocket_connect("/v1/realtime") as ws:
            for message in messages:
                ws.send_text(json.dumps(message))
            try:
                while True:
                    events.append(json.loads(ws.receive_text()))
            except WebSocketDisconnect:
                pass
    return events


# --- the diff -------------------------------------------------------------


@dataclass
class WireDiff:
    kinds: Counter = field(default_factory=Counter)  # reference kinds matched
    extra_kinds: Counter = field(default_factory=Counter)  # ours only (allowed)
    extra_keys: dict[str, set] = field(default_factory=dict)  # allowed
    problems: list[str] = field(default_factory=list)
    audio_frames: int = 0
    audio_vs_offline_max_abs: float = 0.0
    audio_vs_reference_max_abs: float = 0.0  # the codec divergence, not a failure
    audio_reference_lag: int = 0  # samples the reference's audio is late by

    @property
    def ok(self) -> bool:
        return not self.problems

    def report(self) -> str:
        lines = [f"{kind:52s} {count:>5d}  ok" for kind, count in sorted(self.kinds.items())]
        lines += [f"{kind:52s} {count:>5d}  ours only (allowed)"
                  for kind, count in sorted(self.extra_kinds.items())]
        for kind, keys in sorted(self.extra_keys.items()):
            lines.append(f"extra keys in {kind}: {', '.join(sorted(keys))} (allowed)")
        lines.append(f"audio: {self.audio_frames} frames, ours vs our offline decode max-abs "
                     f"{self.audio_vs_offline_max_abs:.3g} (must be 0)")
        lines.append(f"audio: reference {self.audio_reference_lag} samples late, then max-abs "
                     f"{self.audio_vs_reference_max_abs:.3g} (codec divergence #4, reported only)")
        lines += [f"MISMATCH {p}" for p in self.problems]
        return "\n".join(lines)


def json_shape(value: Any) -> Any:
    """JSON types of ``value``: dicts keep their keys, lists their element types."""
    if isinstance(value, dict):
        return {k: json_shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return ["list", sorted({json.dumps(json_shape(v)) for v in value})]
    return type(value).__name__


def _shape_problems(where: str, ours: Any, theirs: Any, extra: set) -> list[str]:
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{where}: {json_shape(ours)} where the reference has an object"]
        problems = []
        for key in theirs:
            if key not in ours:
                problems.append(f"{where}.{key}: missing")
            else:
                problems += _shape_problems(f"{where}.{key}", ours[key], theirs[key], extra)
        extra.update(f"{where}.{key}" for key in ours if key not in theirs)
        return problems
    if isinstance(theirs, list) and theirs and isinstance(ours, list) and ours:
        return [] if json_shape(ours) == json_shape(theirs) else \
            [f"{where}: element types {json_shape(ours)} vs {json_shape(theirs)}"]
    if isinstance(theirs, list) and isinstance(ours, list):
        return []
    if type(ours) is not type(theirs):
        return [f"{where}: {type(ours).__name__} where the reference has {type(theirs).__name__}"]
    return []


def pcm(event: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(event["delta"]), dtype="<i2").astype(np.float32)


def diff_events(ours: list[dict], theirs: list[dict], decode: Any = None) -> WireDiff:
    """Diff our events against the reference's; ``decode(codes (T, Q)) -> samples``."""
    result = WireDiff()
    mine = [e for e in ours if e["type"] in REFERENCE_KINDS]
    result.extra_kinds.update(e["type"] for e in ours if e["type"] not in REFERENCE_KINDS)
    if len(mine) != len(theirs):
        result.problems.append(f"{len(mine)} events of the reference's kinds, reference sent "
                               f"{len(theirs)}: {Counter(e['type'] for e in mine)} vs "
                               f"{Counter(e['type'] for e in theirs)}")
    for n, (a, b) in enumerate(zip(mine, theirs)):
        kind = b["type"]
        where = f"event {n} ({kind})"
        if a["type"] != kind:
            result.problems.append(f"event {n}: type {a['type']!r}, reference {kind!r}")
            continue
        extra: set = set()
        problems = _shape_problems(where, a, b, extra)
        result.extra_keys.setdefault(kind, set()).update(k.split(").", 1)[-1] for k in extra)
        for key in VALUE_FIELDS:
            if key in b and a.get(key) != b[key]:
                problems.append(f"{where}.{key}: {_brief(a.get(key))} vs {_brief(b[key])}")
        if kind != "response.audio.delta" and "delta" in b and a.get("delta") != b["delta"]:
            problems.append(f"{where}.delta: {_brief(a.get('delta'))} vs {_brief(b['delta'])}")
        if kind == "error" and a["error"].get("code") != b["error"].get("code"):
            problems.append(f"{where}.error.code: {a['error'].get('code')} vs {b['error']['code']}")
        result.problems += problems
        if not problems:
            result.kinds[kind] += 1
    if not result.extra_keys.get("error"):
        result.extra_keys.pop("error", None)
    result.extra_keys = {k: v for k, v in result.extra_keys.items() if v}
    _diff_audio(result, [e for e in mine if e["type"] == "response.audio.delta"],
                [e for e in theirs if e["type"] == "response.audio.delta"], decode)
    return result


def _diff_audio(result: WireDiff, ours: list[dict], theirs: list[dict], decode: Any) -> None:
    result.audio_frames = len(ours)
    if not ours:
        return
    indices = [e["frame_index"] for e in ours]
    if indices != list(range(len(ours))):
        result.problems.append(f"audio frame_index runs {indices[:8]}..., not 0, 1, 2, ...")
    if any(not e.get("audio_codes") for e in ours):
        result.problems.append("an audio delta without audio_codes")
    if any(not isinstance(e.get("delta"), str) for e in ours):
        return  # already reported as a missing or mistyped field
    joined = np.concatenate([pcm(e) for e in ours])
    if decode is not None:
        codes = np.array([e["audio_codes"] for e in ours], dtype=np.int32)
        expected = np.round(np.clip(decode(codes), -1.0, 1.0) * 32767.0)
        if expected.shape != joined.shape:
            result.problems.append(f"audio: {joined.shape[0]} samples, offline decode "
                                   f"{expected.shape[0]}")
        else:
            result.audio_vs_offline_max_abs = float(np.max(np.abs(joined - expected)))
            if result.audio_vs_offline_max_abs:
                result.problems.append("audio differs from the offline decode of its codes")
    if theirs:
        # The reference streams the same waveform a few samples late: report
        # the best lag and the difference there.
        reference = np.concatenate([pcm(e) for e in theirs])
        best = None
        for lag in range(MAX_REFERENCE_LAG + 1):
            n = min(len(reference) - lag, len(joined))
            if n <= 0:
                break
            error = float(np.max(np.abs(joined[:n] - reference[lag : lag + n]))) / PCM16_SCALE
            if best is None or error < best[1]:
                best = (lag, error)
        if best is not None:
            result.audio_reference_lag, result.audio_vs_reference_max_abs = best


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def run_wire(checkpoint: str | Path, audio: str | Path | np.ndarray, *,
             system_prompt: str | None = None, seed: int = 0,
             extra_decoding_seconds: float = 1.0, chunk: int = 4000,
             cancel: bool = False) -> WireDiff:
    import mlx.core as mx

    from mlx_voicechat_plugin.runtime.audio import load_waveform

    signal = np.array(load_waveform(audio, 16_000))
    signal = np.concatenate([signal, np.zeros(round(extra_decoding_seconds * 16_000), np.float32)])
    messages = script(signal, str(checkpoint), system_prompt=system_prompt, seed=seed,
                      chunk=chunk, cancel=cancel)
    theirs = reference_events(messages)
    ours = our_events(str(checkpoint), messages)
    from mlx_voicechat_plugin import load

    # MLX arrays belong to the thread that made them: a lazy copy for this one.
    codec = load(checkpoint, lazy=True)[0].tts_model.audio_codec

    def decode(codes: np.ndarray) -> np.ndarray:
        return np.array(codec.decode(mx.array(codes.T[None]))[0, 0])

    return diff_events(ours, theirs, decode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.wire",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("audio")
    parser.add_argument("--system-prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra-decoding-seconds", type=float, default=1.0)
    parser.add_argument("--chunk", type=int, default=4000, help="samples per append")
    parser.add_argument("--cancel", action="store_true", help="end with session.cancel")
    args = parser.parse_args(argv)
    result = run_wire(args.checkpoint, args.audio, system_prompt=args.system_prompt,
                      seed=args.seed, extra_decoding_seconds=args.extra_decoding_seconds,
                      chunk=args.chunk, cancel=args.cancel)
    print(result.report())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
