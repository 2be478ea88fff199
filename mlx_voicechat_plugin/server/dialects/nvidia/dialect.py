"""NVIDIA's VoiceChat realtime dialect, as NeMo-Speech.cpp's ``nemo-speech serve`` speaks it.

Its reference client (``clients/voicechat/nemotron-voicechat-client.py``)
and conformance test speak it unchanged. A session: ``session.created`` on
connect; ``session.update`` (:mod:`.messages`) before the first audio
(the engine session opens; the configuration is immutable after the first
audio frame; audio without one opens the defaults); audio as binary PCM16
frames or base64 ``input_audio_buffer.append``, at its rate (16-48 kHz),
resampled once here to the model's; the output (:mod:`.events`) in
80 ms 24 kHz packets; ``conversation.item.create`` with a
``function_call_output`` taken at once (``tools_not_set`` without tools);
``session.close``: the residual input drained, the response completed, then
``session.end`` with the counters, and the conversation ends.

Errors are ``{"type": "error", "error": {"type", "code", "message"}}`` with
NVIDIA's codes: ``invalid_event`` (the session goes on),
``instructions_too_long``, ``tools_not_set``, ``session_timeout`` and
``inference_error``. It is served at ``/nvidia/v1/realtime`` (the client's
``--server ws://HOST:PORT/nvidia``); ``--nvidia-root`` serves it at
``/v1/realtime`` and ``/realtime`` instead of mlx-vlm's, as NeMo-Speech.cpp
lays them out. The API key may come as ``?api_key=``.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np

from ...messages import Ending, Finished, JsonOut, Outgoing
from ...session.session import Session
from ...wire import (
    ErrorCode, ProtocolError, ToolOutput, bounded, decode_base64, invalid, pcm16_samples,
)
from ..base import Dialect
from ..client_options import session_options
from ..ga.audio import Resampler
from .events import Conversation, Counters, error_event
from .messages import (
    INSTRUCTIONS_TOO_LONG, Append, ClientMessage, Close, Config, Update, parse_message, updated,
)

logger = logging.getLogger(__name__)

INVALID_EVENT = "invalid_event"
SESSION_TIMEOUT = "session_timeout"
# Our codes -> NVIDIA's; the others (inference_error, tools_not_set, server_busy) as they are.
CODES = {ErrorCode.INVALID_REQUEST: INVALID_EVENT,
         ErrorCode.SESSION_INITIALIZATION_FAILED: INVALID_EVENT,
         ErrorCode.TOOL_CALL_INVALID: INVALID_EVENT}
CLIENT_ERRORS = (INVALID_EVENT, INSTRUCTIONS_TOO_LONG, ErrorCode.TOOLS_NOT_SET, SESSION_TIMEOUT)
FIELDS = {"system_prompt": "session.instructions", "tools": "session.tools"}
NVIDIA_PATH = "/nvidia/v1/realtime"
ROOT_PATHS = ("/v1/realtime", "/realtime")


class NvidiaDialect(Dialect):
    """One NVIDIA VoiceChat client's session."""

    name = "nvidia"
    paths: ClassVar[tuple[str, ...]] = (NVIDIA_PATH,)
    query_key = True  # the key may come as ?api_key= (the conformance test's way)
    health = True  # GET <path>/health

    def __init__(self, session: Session, model_id: str):
        super().__init__(session, model_id)
        self.config = Config()
        self.counters = Counters(metrics=session.client_metrics)
        self.output: Conversation | None = None
        self.input: Resampler | None = None
        self.audio_started = False

    # --- the hooks --------------------------------------------------------------------

    def greeting(self) -> JsonOut:
        return JsonOut({"type": "session.created",
                      "session": self.config.describe(self.session_id, self.model_id)})

    def error(self, code: str, message: str) -> JsonOut:
        code = self.wire_code(code)
        kind = "invalid_request_error" if code in CLIENT_ERRORS else "server_error"
        return JsonOut(error_event(kind, code, bounded(message)))

    @classmethod
    def wire_code(cls, code: str) -> str:
        return CODES.get(code, code)

    @classmethod
    def refusal(cls, code: str, message: str) -> dict[str, Any]:
        return error_event("invalid_request_error", cls.wire_code(code), bounded(message))

    def received_audio(self) -> tuple[int, int]:
        return self.session.samples_received, self.counters.input_rate

    def timed_out(self, reason: str) -> JsonOut:
        return self.error(SESSION_TIMEOUT, reason)

    def parse(self, message: str | bytes) -> ClientMessage:
        return parse_message(message)

    def queues_audio(self, message: ClientMessage) -> bool:
        return isinstance(message, Append)

    def translate(self, events: list) -> list[Outgoing]:
        return self.output.translate(events) if self.output is not None else []

    def frame_error(self, exc: BaseException) -> list[Outgoing]:
        self.counters.dropped()
        return super().frame_error(exc)

    async def dispatch(self, message: ClientMessage) -> None:
        if isinstance(message, Append):
            await self.append(message)
        elif isinstance(message, Update):
            if self.audio_started:
                raise invalid("the session configuration is immutable after the first "
                              "audio frame")
            await self.configure(updated(self.config, message.session))
        elif isinstance(message, ToolOutput):
            if not (self.session.is_open and self.session.tools_set):
                raise ProtocolError(ErrorCode.TOOLS_NOT_SET,
                                    "function_call_output needs tools in session.update")
            await self.session.tool_output(message.call_id, message.output)
            self.session.active()
        elif isinstance(message, Close):
            await self.close()

    # --- the session ------------------------------------------------------------------

    async def configure(self, config: Config) -> None:
        options = session_options(self.limits, FIELDS, system_prompt=config.instructions,
                                  tools=list(config.tools) or None, turn_events=True)
        details = await self.session.open_session(options)
        self.config = config
        self.counters.input_rate = config.input_rate
        self.output = Conversation(details.output_sample_rate, self.counters)
        self.input = Resampler(config.input_rate, details.input_sample_rate)
        logger.info("%s configured (input %d Hz, %d tools)", self.session_id,
                    config.input_rate, len(config.tools))
        self.send({"type": "session.updated",
                   "session": config.describe(self.session_id, self.model_id)})
        self.session.active()

    async def append(self, message: Append) -> None:
        self.counters.chunks_received += 1
        try:
            data = message.audio if isinstance(message.audio, bytes) \
                else decode_base64(message.audio, "base64 PCM16")
            samples = pcm16_samples(data, "PCM16")
        except ValueError as exc:
            self.counters.dropped()
            raise invalid(str(exc)) from None
        if not self.session.is_open:
            await self.configure(self.config)
        self.audio_started = True
        self.counters.received(samples.shape[0])
        await self.session.feed_audio(self.input(samples), sent=samples.shape[0])

    async def close(self) -> None:
        """Drain the residual input, complete the response, then ``session.end``."""
        session = self.session
        if session.is_open:
            await session.feed_audio(self.input(np.zeros(0, np.float32), last=True), sent=0)
            events = await session.flush()
            session.send_all(self.output.translate(events))
            session.send_all(self.output.finish())
        self.send({"type": "session.end", "session_id": self.session_id,
                   "stats": self.counters.stats(session.samples_received)})
        raise Finished(Ending.DONE)


class NvidiaRootDialect(NvidiaDialect):
    """The same dialect at ``/v1/realtime`` and ``/realtime`` (``--nvidia-root``), as
    NeMo-Speech.cpp serves it, and at its own path."""

    paths = (*ROOT_PATHS, NVIDIA_PATH)
