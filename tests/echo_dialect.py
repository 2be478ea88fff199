"""A third wire dialect, for the tests: all of it is this module (and one line in a list).

Client messages: ``{"op": "start", "seed": N}`` opens the session,
``{"op": "audio", "pcm": <base64 PCM16 at 16 kHz>}`` streams audio,
``{"op": "stop"}`` ends the input (the rest of the stream, then close 1000).
Server events: ``hello``, ``ready``, one ``event`` per runtime event (its
kind and frame) and ``oops`` for an error.
"""

from __future__ import annotations

from typing import Any

from mlx_voicechat_plugin.server.connection import Connection, Dialect, Finished
from mlx_voicechat_plugin.server.dialects.client_options import session_options
from mlx_voicechat_plugin.server.wire import (
    CloseCode, decode_base64, dumps, invalid, load_object, pcm16_samples,
)

OPS = ("start", "audio", "stop")


class EchoConnection(Connection):
    def translate(self, events: list) -> list[str]:
        return [dumps({"type": "event", "kind": type(e).__name__, "frame": int(e.frame_index)})
                for e in events]

    def greeting(self) -> dict[str, Any]:
        return {"type": "hello", "session": self.session_id}

    def error_payload(self, code: str, message: str) -> dict[str, Any]:
        return {"type": "oops", "code": code, "message": message}

    def parse(self, text: str) -> dict[str, Any]:
        message = load_object(text)
        if message.get("op") not in OPS:
            raise invalid(f"op must be one of {', '.join(OPS)}")
        return message

    def queues_audio(self, message: dict[str, Any]) -> bool:
        return message["op"] == "audio"

    async def dispatch(self, message: dict[str, Any]) -> None:
        if message["op"] == "start":
            options = session_options(self.limits, {"seed": "seed"}, seed=message.get("seed", 0))
            details = await self.open_session(options)
            await self.send({"type": "ready", "frame_samples": details.frame_samples})
        elif not self.configured:
            raise invalid("send start first")
        elif message["op"] == "audio":
            try:
                samples = pcm16_samples(decode_base64(message.get("pcm"), "base64 PCM16"),
                                        "PCM16")
            except ValueError as exc:
                raise invalid(str(exc)) from None
            await self.feed_audio(samples)
        else:
            await self.forward(await self.engine_call(self.engine.flush(self.session_id)))
            raise Finished(CloseCode.NORMAL)
        self.active()


ECHO = Dialect("echo", ("/echo/v1/realtime",), EchoConnection)
