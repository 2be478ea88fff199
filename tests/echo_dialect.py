"""A third wire dialect, for the tests: all of it is this module (and one line in a list).

Client messages: ``{"op": "start", "seed": N}`` opens the session,
``{"op": "audio", "pcm": <base64 PCM16 at 16 kHz>}`` streams audio,
``{"op": "stop"}`` ends the input (the rest of the stream, then close 1000).
Server events: ``hello``, ``ready``, one ``event`` per runtime event (its
kind and frame) and ``oops`` for an error.
"""

from __future__ import annotations

from typing import Any

from mlx_voicechat_plugin.server.dialects.base import Dialect
from mlx_voicechat_plugin.server.dialects.client_options import session_options
from mlx_voicechat_plugin.server.messages import Ending, Finished, JsonOut
from mlx_voicechat_plugin.server.wire import (
    decode_base64, invalid, load_object, pcm16_samples,
)

OPS = ("start", "audio", "stop")


class EchoDialect(Dialect):
    name = "echo"
    paths = ("/echo/v1/realtime",)

    def translate(self, events: list) -> list[JsonOut]:
        return [JsonOut({"type": "event", "kind": type(e).__name__, "frame": int(e.frame_index)})
                for e in events]

    def greeting(self) -> JsonOut:
        return JsonOut({"type": "hello", "session": self.session_id})

    def error(self, code: str, message: str) -> JsonOut:
        return JsonOut({"type": "oops", "code": code, "message": message})

    def parse(self, message: str | bytes) -> dict[str, Any]:
        message = load_object(self.text(message))
        if message.get("op") not in OPS:
            raise invalid(f"op must be one of {', '.join(OPS)}")
        return message

    def queues_audio(self, message: dict[str, Any]) -> bool:
        return message["op"] == "audio"

    async def dispatch(self, message: dict[str, Any]) -> None:
        session = self.session
        if message["op"] == "start":
            options = session_options(self.limits, {"seed": "seed"}, seed=message.get("seed", 0))
            details = await session.open_session(options)
            self.send({"type": "ready", "frame_samples": details.frame_samples})
        elif not session.is_open:
            raise invalid("send start first")
        elif message["op"] == "audio":
            try:
                samples = pcm16_samples(decode_base64(message.get("pcm"), "base64 PCM16"),
                                        "PCM16")
            except ValueError as exc:
                raise invalid(str(exc)) from None
            await session.feed_audio(samples)
        else:
            self.forward(await session.flush())
            raise Finished(Ending.DONE)
        session.active()


ECHO = EchoDialect
