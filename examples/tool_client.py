"""Live tool calling against a realtime VoiceChat server, with real local tools.

    python examples/tool_client.py ws://127.0.0.1:8080/v1/realtime question.wav answer.wav

Registers two tools in ``session.update``: ``get_weather`` (a lookup in a
local table) and ``book_table`` (a reservation book keyed on the party name, so
a corrected call updates the booking instead of double-booking). While audio
streams, each ``response.function_call_arguments.done`` runs the tool and
answers with ``conversation.item.create`` (``function_call_output``); the
server feeds the result into the running timeline and the model speaks on.
Events are read between appends, and the audio goes out at most
``AHEAD_FRAMES`` ahead of the frames the server has answered, so a long
question never leaves the server's events unread.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from websockets.sync.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from file_client import (  # noqa: E402
    AHEAD_FRAMES,
    CHUNK_SAMPLES,
    INPUT_RATE,
    load_question,
    pcm16_base64,
    write_pcm16_wav,
)

WEATHER = {
    "paris": {"condition": "sunny", "temperature_c": 21},
    "london": {"condition": "rain", "temperature_c": 14},
    "tokyo": {"condition": "cloudy", "temperature_c": 18},
}

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
        "ack_messages": ["Let me check the weather."],
    },
    {
        "name": "book_table",
        "description": "Reserve a restaurant table.",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": "Name for the booking"},
                "time": {"type": "string", "description": "Time, e.g. 19:30"},
                "people": {"type": "integer", "description": "Party size"},
            },
            "required": ["name", "time", "people"],
        },
        "ack_messages": ["One moment while I book that."],
    },
]


class LocalTools:
    """The tools' implementations. Bookings are keyed on the party name."""

    def __init__(self) -> None:
        self.bookings: dict[str, dict[str, Any]] = {}
        self.handlers: dict[str, Callable[[dict], dict]] = {
            "get_weather": self.get_weather,
            "book_table": self.book_table,
        }

    def get_weather(self, arguments: dict) -> dict:
        city = str(arguments.get("city", "")).strip()
        found = WEATHER.get(city.lower())
        return {"city": city, **found} if found else {"city": city, "error": "unknown city"}

    def book_table(self, arguments: dict) -> dict:
        key = str(arguments["name"]).strip().lower()
        status = "updated" if key in self.bookings else "booked"
        self.bookings[key] = {"name": arguments["name"], "time": arguments["time"],
                              "people": int(arguments["people"])}
        return {"status": status, **self.bookings[key]}

    def run(self, name: str, arguments_json: str) -> str:
        handler = self.handlers.get(name)
        if handler is None:
            return json.dumps({"error": f"no tool {name}"})
        try:
            return json.dumps(handler(json.loads(arguments_json)))
        except (ValueError, KeyError, TypeError) as error:
            return json.dumps({"error": str(error)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("input", help="question WAV")
    parser.add_argument("output", help="answer WAV to write (22.05 kHz PCM16)")
    parser.add_argument("--system-prompt", default="You are a helpful assistant.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra-seconds", type=float, default=5.0)
    parser.add_argument("--api-key")
    args = parser.parse_args(argv)

    audio = load_question(args.input, args.extra_seconds)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    tools = LocalTools()
    answer, pieces, output_rate, answered = "", [], 22_050, 0

    with connect(args.url, additional_headers=headers, max_size=None) as ws:

        def handle(event: dict) -> None:
            nonlocal answer, output_rate, answered
            kind = event["type"]
            if kind == "response.text.delta":
                answer = event["text"]
            elif kind == "response.audio.delta":
                output_rate = event["sample_rate"]
                answered = event.get("frame_index", answered - 1) + 1
                pieces.append(np.frombuffer(base64.b64decode(event["delta"]), "<i2"))
            elif kind == "response.function_call_arguments.done":
                output = tools.run(event["name"], event["arguments"])
                print(f"[tool] {event['name']}({event['arguments']}) -> {output}")
                ws.send(json.dumps({"type": "conversation.item.create", "item": {
                    "type": "function_call_output", "call_id": event["call_id"], "output": output}}))
            elif kind == "error":
                print(f"[error] {event['error']['code']}: {event['error']['message']}", file=sys.stderr)

        def drain(until: str | None = None, timeout: float | None = 0.0) -> None:
            while True:
                try:
                    event = json.loads(ws.recv(timeout=timeout))
                except TimeoutError:
                    return
                handle(event)
                if until is not None and event["type"] == until:
                    return

        drain("session.created", None)
        ws.send(json.dumps({"type": "session.update", "session": {
            "system_prompt": args.system_prompt, "seed": args.seed, "tools": TOOLS}}))
        drain("session.updated", None)
        for frame, start in enumerate(range(0, len(audio), CHUNK_SAMPLES)):
            while frame - answered > AHEAD_FRAMES:
                handle(json.loads(ws.recv()))  # the server is behind: read, then send on
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": pcm16_base64(audio[start : start + CHUNK_SAMPLES]),
                                "sample_rate": INPUT_RATE}))
            drain()  # answer tool calls while audio keeps flowing
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        drain("response.done", None)

    write_pcm16_wav(args.output, pieces, output_rate)
    print(f"[assistant] {answer}")
    print(f"bookings: {json.dumps(tools.bookings)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
