"""The mlx-vlm realtime dialect (``/v1/realtime``), as ``mlx_vlm.server`` speaks it.

A session: ``session.created``, one ``session.update`` (the session opens:
its prompt prefills), ``input_audio_buffer.append`` (16 kHz PCM16; each
frame's events stream back as it runs), ``conversation.item.create`` with a
``function_call_output``, ``session.ping``; then ``input_audio_buffer.commit``
(the rest of the stream; close 1000) or ``session.cancel`` /
``response.cancel`` (the conversation is done: close 1000). Client messages are parsed into the small
dataclasses below or rejected with the error code the client sees; the
server events are :mod:`.vlm_events`. ``session.model`` is ignored: the
server serves one checkpoint. A binary frame is an ``invalid_request``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Union

from ...quoting import brief
from ..messages import Ending, Finished, JsonOut, Outgoing
from .client_options import session_options, transcription_options
from ..wire import (
    ErrorCode, ProtocolError, ToolOutput, decode_base64, init_failed, invalid,
    load_object, parse_tool_output, pcm16_samples,
)
from . import vlm_events as events
from .base import Dialect

logger = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
INPUT_SAMPLE_RATE = 16_000
OUTPUT_SAMPLE_RATE = 22_050  # announced before the model is known
MODALITIES = ("text", "audio")
# The runtime's option -> the client's field, in error messages.
FIELDS = {"system_prompt": "session.system_prompt", "seed": "session.seed",
          "max_streaming_seconds": "session.max_streaming_seconds",
          "context_seconds": "session.context_seconds",
          "temperature": "session.temperature", "top_p": "session.top_p"}


# --- client messages ----------------------------------------------------


@dataclass(frozen=True)
class SessionUpdate:
    """``session.update``; the runtime's options are checked when the session is built."""

    system_prompt: Any = None
    seed: Any = 0
    max_streaming_seconds: Any = None
    tools: list[Any] | None = None  # validated by the runtime when the session opens
    output_modalities: tuple[str, ...] = MODALITIES
    context_seconds: Any = None  # the bounded context (None: the server's)
    temperature: Any = None  # mlx-lm's sampling names (None: the server's --temperature)
    top_p: Any = None  # the speech head's nucleus (None: the server's --top-p)

    @property
    def text_only(self) -> bool:
        """``output_modalities: ["text"]``: only the user transcript (perception + RNNT)."""
        return self.output_modalities == ("text",)


@dataclass(frozen=True)
class AudioAppend:
    audio: Any  # base64 text
    sample_rate: Any = INPUT_SAMPLE_RATE


@dataclass(frozen=True)
class Commit:
    pad_partial: bool = True


@dataclass(frozen=True)
class Cancel:
    pass


@dataclass(frozen=True)
class Ping:
    pass


ClientMessage = Union[SessionUpdate, AudioAppend, Commit, Cancel, Ping, ToolOutput]


def parse_session(payload: Any) -> SessionUpdate:
    """``session.update.session``; a bad field is ``session_initialization_failed``."""
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise init_failed("session must be an object")
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise init_failed("session.tools must be a list of tool definitions")
    modalities = parse_modalities(payload.get("output_modalities"))
    if modalities == ("text",) and tools is not None:
        raise init_failed("session.tools needs the full session; a text-only session "
                          "(output_modalities ['text']) only transcribes")
    seed = payload.get("seed")
    return SessionUpdate(payload.get("system_prompt"), 0 if seed is None else seed,
                         payload.get("max_streaming_seconds"), tools, modalities,
                         payload.get("context_seconds"), payload.get("temperature"),
                         payload.get("top_p"))


def parse_modalities(value: Any) -> tuple[str, ...]:
    """``session.output_modalities``: ``["text"]`` (transcript only) or with ``"audio"``."""
    if value is None:
        return MODALITIES
    if not isinstance(value, list) or not value or len(value) > len(MODALITIES) \
            or any(m not in MODALITIES for m in value) or len(set(value)) != len(value):
        raise init_failed("session.output_modalities must be ['text'] or ['text', 'audio'], "
                          f"got {brief(value)}")
    if value == ["audio"]:
        raise init_failed("session.output_modalities ['audio'] is not supported: the "
                          "assistant's text comes with its audio; use ['text', 'audio']")
    return tuple(m for m in MODALITIES if m in value)


def parse_message(text: str) -> ClientMessage:
    """One text frame -> a client message (``invalid_request`` when malformed)."""
    message = load_object(text)
    kind = message.get("type")
    if kind == "session.update":
        return parse_session(message.get("session"))
    if kind == "input_audio_buffer.append":
        return AudioAppend(message.get("audio"), message.get("sample_rate", INPUT_SAMPLE_RATE))
    if kind == "input_audio_buffer.commit":
        pad = message.get("pad_partial", True)
        if not isinstance(pad, bool):
            raise invalid("pad_partial must be a boolean")
        return Commit(pad)
    if kind in ("session.cancel", "response.cancel"):
        return Cancel()
    if kind == "session.ping":
        return Ping()
    if kind == "conversation.item.create":
        return parse_tool_output(message.get("item"))
    raise invalid(f"unsupported event type {brief(kind)}")


def check_sample_rate(rate: Any, expected: int) -> int:
    if isinstance(rate, bool) or not isinstance(rate, int):
        raise ProtocolError(ErrorCode.INFERENCE_ERROR,
                            f"sample_rate must be an integer, got {brief(rate)}")
    if rate != expected:
        raise ProtocolError(ErrorCode.INFERENCE_ERROR,
                            f"sample_rate must be {expected} Hz, got {rate}")
    return rate


# --- the dialect ---------------------------------------------------------


class VLMDialect(Dialect):
    """One mlx-vlm client's session: one session, ended by commit or cancel."""

    name = "mlx-vlm"
    paths = (REALTIME_PATH,)

    def greeting(self) -> JsonOut:
        return JsonOut(events.session_created(self.session_id, INPUT_SAMPLE_RATE,
                                            OUTPUT_SAMPLE_RATE))

    def error(self, code: str, message: str) -> JsonOut:
        return JsonOut(events.error_event(code, message))

    def parse(self, message: str | bytes) -> ClientMessage:
        return parse_message(self.text(message))

    def queues_audio(self, message: ClientMessage) -> bool:
        return isinstance(message, AudioAppend)

    def translate(self, runtime_events: list) -> list[Outgoing]:
        return events.translate(runtime_events)

    async def dispatch(self, message: ClientMessage) -> None:
        session = self.session
        if isinstance(message, Ping):
            self.send({"type": "session.pong"})
            return
        if isinstance(message, SessionUpdate):
            await self.configure(message)
            session.active()
            return
        if not session.is_open:
            raise invalid("send session.update before audio")
        if isinstance(message, ToolOutput):
            await session.tool_output(message.call_id, message.output)
            session.active()
        elif isinstance(message, AudioAppend):
            await self.append(message)
        elif isinstance(message, Commit):
            flushed = await session.flush(message.pad_partial)
            session.send_all(events.committed(flushed, session.frames_run))
            raise Finished(Ending.DONE)
        else:
            self.forward(await session.cancel())
            raise Finished(Ending.DONE)

    async def configure(self, update: SessionUpdate) -> None:
        if self.session.is_open:
            raise invalid("the active session cannot be reconfigured")
        options = session_options(
            self.limits, FIELDS, system_prompt=update.system_prompt, seed=update.seed,
            max_streaming_seconds=update.max_streaming_seconds, tools=update.tools,
            context_seconds=update.context_seconds, temperature=update.temperature,
            top_p=update.top_p)
        # Text-only: perception + RNNT, the user transcript.
        opened = transcription_options(self.limits, options) if update.text_only else options
        details = await self.session.open_session(opened)
        logger.info("%s configured (seed %d, max %.1f s)", self.session_id, options.seed,
                    options.max_streaming_seconds)
        self.send(events.session_updated(self.session_id, self.model_id, details))

    async def append(self, message: AudioAppend) -> None:
        try:
            samples = pcm16_samples(decode_base64(message.audio, "base64 PCM16"), "PCM16")
        except ValueError as exc:
            raise ProtocolError(ErrorCode.INFERENCE_ERROR, str(exc)) from None
        check_sample_rate(message.sample_rate, self.session.details.input_sample_rate)
        await self.session.feed_audio(samples)
