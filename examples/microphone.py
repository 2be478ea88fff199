"""Talk to a realtime VoiceChat server from the microphone; hear its answer.

    python examples/microphone.py ws://127.0.0.1:8080/v1/realtime

Captured audio is mixed down to mono, resampled to 16 kHz and sent in 80 ms
appends; the spoken answer plays as it arrives and the text is printed.
Press Ctrl-C to commit (the server finishes the answer, then closes).
Needs ``websockets``, ``numpy`` and ``sounddevice`` (with PortAudio).
"""

from __future__ import annotations

import argparse
import base64
import json
import queue
import sys
import threading
import time
from typing import Any, Iterator

import numpy as np

INPUT_RATE = 16_000
OUTPUT_RATE = 22_050  # the server announces its rate in session.created
CHUNK_SAMPLES = 1280  # 80 ms at 16 kHz
RING_SECONDS = 60.0
BLOCK_SECONDS = 0.02
DRAIN_TIMEOUT = 120.0

SOUNDDEVICE_HINT = ("sounddevice is not usable ({error}). Install it with "
                    "`pip install sounddevice` and PortAudio with `apt-get install "
                    "libportaudio2` (Linux) or `brew install portaudio` (macOS).")
DEVICE_HINT = ("cannot open the {kind} device ({error}). Run with --list-devices and "
               "pick one with --{kind}-device.")


# --- pure helpers (tested without sounddevice) --------------------------


def session_message(system_prompt: str | None = None, seed: int = 0) -> dict[str, Any]:
    session: dict[str, Any] = {"seed": seed}
    if system_prompt:
        session["system_prompt"] = system_prompt
    return {"type": "session.update", "session": session}


def pcm16_base64(samples: np.ndarray) -> str:
    pcm = np.clip(np.round(np.asarray(samples) * 32768.0), -32768, 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode("ascii")


def append_message(samples: np.ndarray) -> dict[str, Any]:
    return {"type": "input_audio_buffer.append", "audio": pcm16_base64(samples),
            "sample_rate": INPUT_RATE}


def commit_message() -> dict[str, Any]:
    return {"type": "input_audio_buffer.commit"}


def decode_audio_delta(event: dict[str, Any]) -> np.ndarray:
    """``response.audio.delta`` audio as float32 in [-1, 1)."""
    pcm = np.frombuffer(base64.b64decode(event["delta"]), dtype="<i2")
    return pcm.astype(np.float32) / 32768.0


def downmix(block: np.ndarray) -> np.ndarray:
    """``(frames,)`` or ``(frames, channels)`` -> mono float32."""
    block = np.asarray(block, dtype=np.float32)
    return block if block.ndim == 1 else block.mean(axis=1)


class StreamResampler:
    """Linear-interpolation resampling of a stream fed in arbitrary blocks.

    Feeding a signal block by block gives the same samples as feeding it at once.
    """

    def __init__(self, source_rate: int, target_rate: int):
        self.step = source_rate / target_rate  # source samples per output sample
        self.position = 0.0  # next output time, in source samples from ``previous``
        self.previous: np.ndarray = np.zeros(0, np.float32)
        self.identity = source_rate == target_rate

    def __call__(self, block: np.ndarray) -> np.ndarray:
        block = np.asarray(block, dtype=np.float32)
        if self.identity:
            return block
        signal = np.concatenate([self.previous, block])
        if signal.shape[0] < 2:
            self.previous = signal
            return np.zeros(0, np.float32)
        count = int(np.floor((signal.shape[0] - 1 - self.position) / self.step)) + 1
        count = max(count, 0)
        times = self.position + self.step * np.arange(count)
        out = np.interp(times, np.arange(signal.shape[0]), signal).astype(np.float32)
        next_time = self.position + self.step * count
        keep = int(np.floor(next_time))  # source samples no longer needed
        keep = min(keep, signal.shape[0] - 1)
        self.previous = signal[keep:]
        self.position = next_time - keep
        return out


class Chunker:
    """Collects samples and hands them out in ``size``-sample chunks."""

    def __init__(self, size: int = CHUNK_SAMPLES):
        self.size = size
        self.pending: np.ndarray = np.zeros(0, np.float32)

    def push(self, samples: np.ndarray) -> Iterator[np.ndarray]:
        self.pending = np.concatenate([self.pending, np.asarray(samples, np.float32)])
        while self.pending.shape[0] >= self.size:
            chunk, self.pending = self.pending[: self.size], self.pending[self.size :]
            yield chunk

    def flush(self) -> np.ndarray:
        """The remaining partial chunk (possibly empty)."""
        rest, self.pending = self.pending, np.zeros(0, np.float32)
        return rest


class RingBuffer:
    """A thread-safe mono float32 FIFO of fixed capacity for audio playback.

    Writes past capacity drop the oldest samples; reads past the end are padded
    with silence, so the output callback never blocks.
    """

    def __init__(self, capacity: int):
        self.data = np.zeros(capacity, np.float32)
        self.start = 0
        self.size = 0
        self.lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.data.shape[0]

    def __len__(self) -> int:
        return self.size

    def write(self, samples: np.ndarray) -> int:
        """Append ``samples``; returns how many old samples were dropped."""
        samples = np.asarray(samples, np.float32)[-self.capacity :]
        with self.lock:
            dropped = max(self.size + samples.shape[0] - self.capacity, 0)
            self.start = (self.start + dropped) % self.capacity
            self.size -= dropped
            end = (self.start + self.size) % self.capacity
            first = min(samples.shape[0], self.capacity - end)
            self.data[end : end + first] = samples[:first]
            self.data[: samples.shape[0] - first] = samples[first:]
            self.size += samples.shape[0]
        return dropped

    def read(self, count: int) -> np.ndarray:
        """``count`` samples: the oldest stored ones, then zeros."""
        out = np.zeros(count, np.float32)
        with self.lock:
            take = min(count, self.size)
            first = min(take, self.capacity - self.start)
            out[:first] = self.data[self.start : self.start + first]
            out[first:take] = self.data[: take - first]
            self.start = (self.start + take) % self.capacity
            self.size -= take
        return out


def event_text(event: dict[str, Any]) -> str | None:
    """What to print for a server event as it arrives (``None``: nothing)."""
    kind = event.get("type")
    if kind == "conversation.item.input_audio_transcription.delta":
        return f"[user] {event['delta']}"
    if kind == "response.text.delta":
        return event["delta"]
    if kind == "error":
        return f"\n[error] {event['error']['code']}: {event['error']['message']}"
    if kind == "session.updated":
        return f"[ready: {event['session'].get('model')}] speak; Ctrl-C to commit"
    if kind == "response.done":
        return "\n[done]"
    return None


# --- audio devices ------------------------------------------------------


def import_sounddevice() -> Any:
    try:
        import sounddevice
    except (ImportError, OSError) as exc:  # OSError: PortAudio missing
        raise SystemExit(SOUNDDEVICE_HINT.format(error=exc)) from None
    return sounddevice


def device_arg(value: str | None) -> int | str | None:
    if value is None:
        return None
    return int(value) if value.isdigit() else value


def open_stream(sd: Any, kind: str, **options: Any) -> Any:
    factory = sd.InputStream if kind == "input" else sd.OutputStream
    try:
        stream = factory(**options)
        stream.start()
    except Exception as exc:  # sd.PortAudioError, ValueError for bad devices
        raise SystemExit(DEVICE_HINT.format(kind=kind, error=exc)) from None
    return stream


class Player:
    """Plays received audio through a ring buffer and an output stream."""

    def __init__(self, sd: Any, device: int | str | None, source_rate: int):
        try:  # prefer the server's rate; fall back to the device's own
            sd.check_output_settings(device=device, samplerate=source_rate, channels=1)
            rate = source_rate
        except Exception:
            rate = int(sd.query_devices(device, "output")["default_samplerate"])
        self.rate = rate
        self.resample = StreamResampler(source_rate, rate)
        self.ring = RingBuffer(int(RING_SECONDS * rate))
        self.stream = open_stream(sd, "output", device=device, samplerate=rate, channels=1,
                                  dtype="float32", blocksize=int(BLOCK_SECONDS * rate),
                                  callback=self.callback)

    def callback(self, outdata: np.ndarray, frames: int, _time: Any, _status: Any) -> None:
        outdata[:, 0] = self.ring.read(frames)

    def play(self, samples: np.ndarray) -> None:
        self.ring.write(self.resample(samples))

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ring) and time.monotonic() < deadline:
            time.sleep(BLOCK_SECONDS)
        self.stream.stop()
        self.stream.close()


def receive(ws: Any, player_factory: Any, ready: threading.Event) -> None:
    """Print text deltas and play audio until the server closes."""
    from websockets.exceptions import ConnectionClosed

    player = None
    try:
        for raw in ws:
            event = json.loads(raw)
            kind = event.get("type")
            if kind == "session.created":
                player = player_factory(event["session"]["output_audio_format"]["sample_rate"])
            elif kind == "session.updated":
                ready.set()
            elif kind == "response.audio.delta" and player is not None:
                player.play(decode_audio_delta(event))
            text = event_text(event)
            if text is not None:
                end = "" if kind == "response.text.delta" else "\n"
                print(text, end=end, flush=True)
    except ConnectionClosed:
        pass
    finally:
        ready.set()
        if player is not None:
            player.drain(DRAIN_TIMEOUT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", help="ws://HOST:PORT/v1/realtime")
    parser.add_argument("--list-devices", action="store_true", help="list audio devices, exit")
    parser.add_argument("--input-device", help="microphone (index or name)")
    parser.add_argument("--output-device", help="speaker (index or name)")
    parser.add_argument("--system-prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key")
    args = parser.parse_args(argv)

    sd = import_sounddevice()
    if args.list_devices:
        print(sd.query_devices())
        return 0
    if not args.url:
        parser.error("the server URL is required")
    from websockets.sync.client import connect

    input_device, output_device = device_arg(args.input_device), device_arg(args.output_device)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    blocks: queue.Queue[np.ndarray | None] = queue.Queue()

    def on_audio(indata: np.ndarray, _frames: int, _time: Any, _status: Any) -> None:
        blocks.put(indata.copy())

    with connect(args.url, additional_headers=headers, max_size=None) as ws:
        ready = threading.Event()
        receiver = threading.Thread(
            target=receive, args=(ws, lambda rate: Player(sd, output_device, rate), ready),
            daemon=True)
        receiver.start()
        ws.send(json.dumps(session_message(args.system_prompt, args.seed)))
        ready.wait()
        rate = int(sd.query_devices(input_device, "input")["default_samplerate"])
        microphone = open_stream(sd, "input", device=input_device, samplerate=rate,
                                 channels=1, dtype="float32",
                                 blocksize=int(BLOCK_SECONDS * rate), callback=on_audio,
                                 finished_callback=lambda: blocks.put(None))
        resample, chunker = StreamResampler(rate, INPUT_RATE), Chunker()
        try:
            while receiver.is_alive():
                try:
                    block = blocks.get(timeout=0.1)
                except queue.Empty:
                    continue
                if block is None:  # the input stream ended
                    break
                for chunk in chunker.push(resample(downmix(block))):
                    ws.send(json.dumps(append_message(chunk)))
        except KeyboardInterrupt:
            print("\n[commit]", file=sys.stderr)
        finally:
            microphone.stop()
            microphone.close()
        if receiver.is_alive():
            rest = chunker.flush()
            if rest.shape[0]:
                ws.send(json.dumps(append_message(rest)))
            ws.send(json.dumps(commit_message()))
            receiver.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
