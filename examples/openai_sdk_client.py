"""The official OpenAI SDK's realtime (GA) client against a local VoiceChat server.

    mlx-voicechat serve -m CKPT --port 8080 --api-key local-key
    python examples/openai_sdk_client.py http://127.0.0.1:8080/openai/v1 question.wav answer.wav \
        --api-key local-key --model CKPT_DIR_NAME

Nothing here is specific to this server but the base URL: the client turns
turn detection off (push-to-talk), streams the question as 24 kHz
``audio/pcm`` while it reads the events, commits it, and waits for the
answer's ``response.done`` (the server runs the model on silence until the
answer ends; no quiet-second guess). A full-duplex model may speak, and call
tools, while it still hears the question: those responses come before the
server's ``input_audio_buffer.committed``, so the answer is the response open
at that event or the next one. It prints both transcripts, answers
``get_weather`` calls (whenever they come) with a ``function_call_output``
and a ``response.create`` tagged with the call's id in its ``metadata``
(waiting for that answer's end too) and writes the
``response.output_audio.delta`` audio to ``answer.wav`` (24 kHz). An
``error`` event, or no answer within ``--timeout`` seconds, is one line on
standard error and exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import wave
from pathlib import Path

import numpy as np
import soxr
from openai import AsyncOpenAI

GA_RATE = 24_000
CHUNK_MS = 100
WEATHER = {"paris": {"condition": "sunny", "temperature_c": 21}}
TOOLS = [{
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}]


def read_wav_24k(path: str) -> bytes:
    """A mono or stereo PCM16 WAV, as 24 kHz mono PCM16 bytes."""
    with wave.open(path, "rb") as wav:
        if wav.getsampwidth() != 2:
            raise SystemExit(f"{path}: only 16-bit PCM WAV files are supported")
        data = np.frombuffer(wav.readframes(wav.getnframes()), "<i2").astype(np.float32)
        samples = data.reshape(-1, wav.getnchannels()).mean(axis=1) / 32768.0
        rate = wav.getframerate()
    samples = soxr.resample(samples, rate, GA_RATE) if rate != GA_RATE else samples
    return np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def get_weather(arguments: str) -> str:
    city = str(json.loads(arguments or "{}").get("city", "")).lower()
    return json.dumps(WEATHER.get(city, {"error": f"no weather for {city!r}"}))


async def converse(args: argparse.Namespace) -> int:
    client = AsyncOpenAI(api_key=args.api_key, base_url=args.base_url)
    audio = read_wav_24k(args.question) + bytes(round(args.extra_seconds * GA_RATE) * 2)
    step = GA_RATE * CHUNK_MS // 1000 * 2
    answer: list[bytes] = []
    named = {"model": args.model} if args.model else {}  # ?model=, checked by the server
    # The server reads audio only as fast as the model hears it (a bounded input
    # buffer), so a keepalive pong can wait behind a long file's queued audio for
    # longer than websockets' 20 s: --timeout bounds the wait instead.
    keepalive = {"ping_timeout": None}
    async with client.realtime.connect(**named, websocket_connection_options=keepalive) \
            as connection:
        await connection.session.update(session={
            "type": "realtime", "instructions": args.instructions, "tools": TOOLS,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": GA_RATE},
                                "turn_detection": None},
                      "output": {"format": {"type": "audio/pcm", "rate": GA_RATE}}},
        })

        async def stream() -> None:
            for start in range(0, len(audio), step):
                chunk = base64.b64encode(audio[start : start + step]).decode()
                await connection.input_audio_buffer.append(audio=chunk)
                if args.realtime:
                    await asyncio.sleep(CHUNK_MS / 1000)
            await connection.input_audio_buffer.commit()  # the answer is owed from here

        async def answered() -> str | None:
            """Read until the owed answers are done: ``None``, or the error that ended it."""
            committed = False  # the server heard the whole question (our commit)
            question = False  # the question's answer is the next response to open
            active: str | None = None  # the response in progress
            calls: set[str] = set()  # tool results whose answer has not opened yet
            owed: set[str] = set()  # responses answering us, not done yet
            async for event in connection:
                if event.type == "response.output_audio.delta":
                    answer.append(base64.b64decode(event.delta))
                elif event.type == "response.output_audio_transcript.done":
                    print(f"[assistant] {event.transcript}")
                elif event.type == "conversation.item.input_audio_transcription.completed":
                    print(f"[user] {event.transcript}")
                elif event.type == "response.function_call_arguments.done":
                    output = get_weather(event.arguments)
                    print(f"[tool] {event.name}({event.arguments}) -> {output}")
                    await connection.conversation.item.create(item={
                        "type": "function_call_output", "call_id": event.call_id,
                        "output": output})
                    await connection.response.create(
                        response={"metadata": {"answers": event.call_id}})
                    calls.add(event.call_id)
                elif event.type == "response.created":
                    active = event.response.id
                    tag = (event.response.metadata or {}).get("answers")
                    if tag in calls:
                        calls.discard(tag)
                        owed.add(active)
                    elif question:
                        question = False
                        owed.add(active)
                elif event.type == "input_audio_buffer.committed":
                    committed = True  # what came before was the model talking while it heard
                    if active is None:
                        question = True
                    else:
                        owed.add(active)
                elif event.type == "response.done":
                    active = None
                    owed.discard(event.response.id)
                    if committed and not (question or calls or owed):
                        return None
                elif event.type == "error":
                    return f"{event.error.code}: {event.error.message}"
            return "the server closed the connection before the answer"

        sender = asyncio.ensure_future(stream())
        try:
            error = await asyncio.wait_for(answered(), args.timeout)
        except asyncio.TimeoutError:
            error = f"no answer within {args.timeout:g} s (--timeout)"
        finally:
            sender.cancel()
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    with wave.open(args.answer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(GA_RATE)
        out.writeframes(b"".join(answer))
    print(f"wrote {len(b''.join(answer)) / 2 / GA_RATE:.2f} s of answer to {args.answer}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_url", help="e.g. http://127.0.0.1:8080/openai/v1")
    parser.add_argument("question", help="a PCM16 WAV file (any rate)")
    parser.add_argument("answer", help="where the answer's audio goes (24 kHz WAV)")
    parser.add_argument("--api-key", default="local", help="the server's --api-key, if any")
    parser.add_argument("--model", default=None,
                        help="the served model name (checked, never loaded); default: none sent")
    parser.add_argument("--instructions", default="You are a helpful assistant.")
    parser.add_argument("--extra-seconds", type=float, default=0.0,
                        help="silence streamed after the question (the server runs the "
                             "model on silence until the answer ends anyway)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for the answer's end")
    parser.add_argument("--realtime", action="store_true", help="pace the audio in real time")
    args = parser.parse_args(argv)
    if Path(args.question).suffix.lower() != ".wav":
        parser.error("the question must be a .wav file")
    return asyncio.run(converse(args))


if __name__ == "__main__":
    raise SystemExit(main())
