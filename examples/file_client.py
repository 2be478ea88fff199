"""Send a WAV file to a realtime VoiceChat server; save the spoken answer.

    python examples/file_client.py ws://127.0.0.1:8080/v1/realtime question.wav answer.wav

The input is resampled to 16 kHz mono, followed by ``--extra-seconds`` of
silence (time for the model to answer), sent in 80 ms appends, then committed.
Events are read while the audio is sent (a thread), so a long file's answer
never waits behind its own question, and the audio goes out at most
``AHEAD_FRAMES`` ahead of the frames the server has answered; the client is
done at ``response.done``.
The transcript and the answer text are printed; the received audio is written
as a 22.05 kHz mono PCM16 WAV. An error, or a connection the server closed
first, is one line on standard error and exit status 1. Needs ``websockets``
and ``numpy``.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import threading
import wave
from math import gcd

import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

INPUT_RATE = 16_000
CHUNK_SAMPLES = 1280  # 80 ms at 16 kHz
# Frames sent ahead of the last one the server answered (each frame's
# response.audio.delta carries its frame_index): the server's default input
# buffer, 2 s. Sending further ahead only queues audio in the sockets, where the
# server's keepalive pings wait behind it.
AHEAD_FRAMES = 25


def read_wav(path: str) -> tuple[np.ndarray, int]:
    """Mono float32 in [-1, 1] and the file's rate (8/16/32-bit PCM)."""
    with wave.open(path, "rb") as handle:
        rate, channels, width = handle.getframerate(), handle.getnchannels(), handle.getsampwidth()
        raw = handle.readframes(handle.getnframes())
    if width == 1:
        data = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        data = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 4:
        data = np.frombuffer(raw, "<i4").astype(np.float32) / 2147483648.0
    else:
        raise ValueError(f"unsupported WAV sample width {width}")
    return data.reshape(-1, channels).mean(axis=1), rate


def resample(samples: np.ndarray, rate: int, target: int = INPUT_RATE) -> np.ndarray:
    if rate == target:
        return samples.astype(np.float32)
    try:
        from scipy.signal import resample_poly

        step = gcd(rate, target)
        return resample_poly(samples, target // step, rate // step).astype(np.float32)
    except ImportError:  # linear interpolation is enough for a demo
        times = np.arange(round(len(samples) * target / rate)) / target
        return np.interp(times, np.arange(len(samples)) / rate, samples).astype(np.float32)


def pcm16_base64(samples: np.ndarray) -> str:
    pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode("ascii")


def load_question(path: str, extra_seconds: float) -> np.ndarray:
    """The question WAV at 16 kHz mono, followed by ``extra_seconds`` of silence."""
    samples, rate = read_wav(path)
    silence = np.zeros(round(extra_seconds * INPUT_RATE), np.float32)
    return np.concatenate([resample(samples, rate), silence])


def write_pcm16_wav(path: str, pieces: list[np.ndarray], rate: int) -> np.ndarray:
    """Join received PCM16 pieces and write them as a mono WAV; returns the samples."""
    pcm = np.concatenate(pieces) if pieces else np.zeros(0, "<i2")
    with wave.open(path, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.astype("<i2").tobytes())
    return pcm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="ws://HOST:PORT/v1/realtime")
    parser.add_argument("input", help="question WAV (any rate, mono or stereo)")
    parser.add_argument("output", help="answer WAV to write (22.05 kHz PCM16)")
    parser.add_argument("--system-prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra-seconds", type=float, default=3.0)
    parser.add_argument("--api-key")
    args = parser.parse_args(argv)

    audio = load_question(args.input, args.extra_seconds)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    session: dict = {"seed": args.seed}
    if args.system_prompt:
        session["system_prompt"] = args.system_prompt

    state = {"transcript": "", "answer": "", "rate": 22_050, "error": None, "done": False,
             "answered": 0}
    progress = threading.Condition()
    pieces: list[np.ndarray] = []
    with connect(args.url, additional_headers=headers, max_size=None) as ws:

        def handle(event: dict) -> None:
            kind = event["type"]
            if kind == "error":
                state["error"] = f"{event['error']['code']}: {event['error']['message']}"
            elif kind == "conversation.item.input_audio_transcription.delta":
                state["transcript"] = event["transcript"]
            elif kind == "response.text.delta":
                state["answer"] = event["text"]
            elif kind == "response.audio.delta":
                state["rate"] = event["sample_rate"]
                pieces.append(np.frombuffer(base64.b64decode(event["delta"]), "<i2"))
                with progress:
                    state["answered"] = event.get("frame_index", state["answered"]) + 1
                    progress.notify()
            elif kind == "response.done":
                state["done"] = True

        def until(kind: str) -> None:
            while True:
                event = json.loads(ws.recv())
                handle(event)
                if event["type"] == kind or state["error"]:
                    return

        def read_to_the_end() -> None:
            try:
                until("response.done")
            except ConnectionClosed as closed:
                if not state["error"]:
                    reason = closed.rcvd.reason if closed.rcvd else "no close frame"
                    state["error"] = f"the server closed the connection: {reason}"
            finally:
                with progress:
                    progress.notify()

        until("session.created")
        ws.send(json.dumps({"type": "session.update", "session": session}))
        until("session.updated")
        if state["error"]:
            print(f"error: {state['error']}", file=sys.stderr)
            return 1
        reader = threading.Thread(target=read_to_the_end, daemon=True)
        reader.start()
        try:
            for frame, start in enumerate(range(0, len(audio), CHUNK_SAMPLES)):
                with progress:
                    while frame - state["answered"] > AHEAD_FRAMES and reader.is_alive():
                        progress.wait(1.0)
                if not reader.is_alive():
                    break  # an error, or the server closed
                chunk = audio[start : start + CHUNK_SAMPLES]
                ws.send(json.dumps({"type": "input_audio_buffer.append",
                                    "audio": pcm16_base64(chunk), "sample_rate": INPUT_RATE}))
            else:
                ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        except ConnectionClosed:
            pass  # the reader says why
        reader.join()
    if state["error"] or not state["done"]:
        print(f"error: {state['error'] or 'the session ended before the answer'}",
              file=sys.stderr)
        return 1

    transcript, answer, output_rate = state["transcript"], state["answer"], state["rate"]
    pcm = write_pcm16_wav(args.output, pieces, output_rate)
    print(f"[user] {transcript}")
    print(f"[assistant] {answer}")
    print(f"wrote {args.output} ({len(pcm) / output_rate:.2f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
