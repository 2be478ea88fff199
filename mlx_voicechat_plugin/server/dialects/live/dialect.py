"""OpenAI's GPT-Live protocol (``/openai/v1/live/sessions``): a full-duplex session.

A GPT-Live client's ``base_url`` is ``http://HOST:PORT/openai/v1`` (the same as the
Realtime GA dialect's). Admission, keys, limits, timeouts, resume and backpressure are
every dialect's; the language is one :class:`LiveDialect` per session (its config
:mod:`.config`, its output :mod:`.timeline`, its delegations :mod:`.delegations`):

- Nothing is sent on connect. ``session.start`` (strict: an unknown field is
  ``unknown_parameter``) opens the engine session with the instructions, the text
  history and the function tools, and answers ``session.started`` with the resolved
  session; anything else first is ``session_not_started`` (the session stays usable).
- ``session.input_audio.append``: base64 audio in the session's format, at most
  :data:`MAX_APPEND_SECONDS` of it (``invalid_value``, param ``audio``, over that);
  ``mute`` feeds silence in its place until ``unmute`` (``session.input_audio.muted`` /
  ``unmuted``). The client never commits: the model listens and speaks at once.
- ``session.instructions.append``, ``session.thinking.append`` and
  ``session.commentary.append`` (``delegation_id`` null, as with Responses delegation):
  before the model has heard audio their text joins its prompt (context; commentary as
  something to say), acknowledged with ``*.appended``; after, the model takes text only
  as a delegation's result, so they are refused (``unsupported_after_audio``).
- ``session.update``: ``delegation`` (same type) and ``triggers`` (empty) only; new
  tools re-open the session before audio and are refused after it.
- ``response.item.create`` with a ``function_call_output`` answers a delegated call (an
  unknown or answered ``call_id`` is ``invalid_value``); ``response.create`` ends the
  delegated response.
- ``session.close``: the input's tail drained, the frames run, then ``session.closed``
  (``close_requested``) with the final usage; a deadline or the stream's bound closes
  with ``expired``.
- Decisions (``decision.*``) and audio fixtures are refused (``unsupported_event``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....quoting import brief
from ....runtime.options import ConversationOptions
from ...messages import AudioIn, Ending, Finished, JsonOut, Outgoing
from ...session.session import Session, stream_full
from ...wire import (ErrorCode, ProtocolError, bounded, decode_base64, load_object,
                     pcm16_samples)
from ..base import Dialect
from ..client_options import session_options
from ..ga.audio import PCM, FormatError, Resampler, decode
from .config import (LiveConfig, LiveError, bad, missing, parse_start, parse_update,
                     strict_object, system_prompt, unknown)
from .delegations import Delegations
from .timeline import LiveTimeline, usage

logger = logging.getLogger(__name__)

LIVE_PATH = "/openai/v1/live/sessions"
MAX_APPEND_SECONDS = 10  # audio one session.input_audio.append may carry
MAX_APPEND_CHARS = 2_000  # an instructions / thinking / commentary append (~500 tokens)
APPENDS = {"session.instructions.append": ("session.instructions.appended", "{}"),
           "session.thinking.append": ("session.thinking.appended", "Context: {}"),
           "session.commentary.append": ("session.commentary.appended",
                                         "Say to the user: {}")}
# Each client event type -> its fields, as the openai package's types name them.
CLIENT_FIELDS = {
    "session.start": ("session",), "session.update": ("session",),
    "session.input_audio.append": ("audio",), "session.input_audio.mute": (),
    "session.input_audio.unmute": (), "session.close": (),
    "response.item.create": ("item",), "response.create": (),
    **{kind: ("content", "delegation_id") for kind in APPENDS},
}
REFUSED = {"session.output_audio.fixture.play": "audio fixtures",
           "decision.create": "Decisions", "decision.item.create": "Decisions",
           "decision.item.delete": "Decisions"}
SERVER_ERRORS = (ErrorCode.INFERENCE_ERROR, ErrorCode.SERVER_BUSY)
FIELDS = {"system_prompt": "session.instructions",
          "tools": "session.delegation.responses.tools"}


def error_event(code: str, message: str, param: str | None = None,
                client_event_id: str | None = None) -> dict[str, Any]:
    """GPT-Live's error: ``{"type": "error", "error": {"type", "code", "message", ...}}``."""
    kind = "server_error" if code in SERVER_ERRORS else "invalid_request_error"
    error: dict[str, Any] = {"type": kind, "code": code, "message": bounded(message)}
    if param is not None:
        error["param"] = param
    out: dict[str, Any] = {"type": "error", "error": error}
    if client_event_id is not None:
        error["client_event_id"] = client_event_id
        out["client_event_id"] = client_event_id
    return out


@dataclass(frozen=True)
class ClientEvent:
    kind: str
    message: dict[str, Any]
    media: AudioIn | None = None  # an append's audio from a media track (WebRTC)


class LiveDialect(Dialect):
    """One GPT-Live client's session with the engine."""

    name = "openai-live"
    paths = (LIVE_PATH,)
    any_model = True

    def __init__(self, session: Session, model_id: str):
        super().__init__(session, model_id)
        self.config: LiveConfig | None = None  # set by session.start
        self.expires_at = int(time.time() + self.limits.max_session_wall_seconds)
        self.delegations = Delegations("")
        self.timeline: LiveTimeline | None = None
        self.input: Resampler | None = None
        self.media: Resampler | None = None  # a media track's rate -> the model's
        self.appended: tuple[str, ...] = ()  # context taken into the prompt
        self.muted = False
        self.event_id: str | None = None  # of the client event being handled
        self.param: str | None = None  # of the error being answered

    # --- the dialect -----------------------------------------------------------------

    def greet(self) -> None:
        """Nothing: a GPT-Live client speaks first (``session.start``)."""
        return None

    def error(self, code: str, message: str) -> JsonOut:
        param, self.param = self.param, None
        return JsonOut(error_event(code, message, param, self.event_id))

    @classmethod
    def refusal(cls, code: str, message: str) -> dict[str, Any]:
        return error_event(code, message)

    def timed_out(self, reason: str) -> JsonOut:
        """Before ``session.started`` an error (no session to close); after, the session
        closes as ``expired``."""
        if self.config is None:
            return self.error("session_expired", reason.replace("session.update",
                                                                "session.start"))
        return self.closed("expired")

    def received_audio(self) -> tuple[int, int]:
        rate = self.config.format.rate if self.config is not None else 24_000
        return self.session.samples_received, rate

    def parse(self, message: str | bytes) -> ClientEvent:
        self.event_id, self.param = None, None
        event = load_object(self.text(message))
        event_id = event.get("event_id")
        self.event_id = event_id if isinstance(event_id, str) else None
        kind = event.get("type")
        try:
            if kind in REFUSED:
                raise LiveError("unsupported_event", f"{kind} needs {REFUSED[kind]}, which "
                                "this server does not have", "type")
            if kind not in CLIENT_FIELDS:
                raise bad("type", f"unsupported event type {brief(kind)}")
            for key in event:
                if key not in ("type", "event_id") + CLIENT_FIELDS[kind]:
                    raise unknown(key)
            if kind != "session.start" and kind != "session.close" and self.config is None:
                raise LiveError("session_not_started", f"{kind} before session.started: send "
                                "session.start first and wait for session.started")
        except LiveError as exc:
            self.param = exc.param
            raise
        return ClientEvent(kind, event)

    def audio_in(self, audio: AudioIn) -> ClientEvent:
        """Media audio (WebRTC): an append of it; before ``session.started`` it is
        dropped (media cannot wait, and the call's start is on its way)."""
        self.event_id, self.param = None, None
        return ClientEvent("session.input_audio.append", {}, audio)

    def queues_audio(self, event: ClientEvent) -> bool:
        return event.kind == "session.input_audio.append"

    def translate(self, events: list) -> list[Outgoing]:
        return self.timeline.translate(events) if self.timeline is not None else []

    def frame_error(self, exc: BaseException) -> list[Outgoing]:
        if stream_full(exc):  # max_streaming_seconds: the session's duration limit
            self.session.halt(Finished(Ending.DONE))
            return [self.closed("expired")]
        return super().frame_error(exc)

    async def dispatch(self, event: ClientEvent) -> None:
        try:
            await self.act(event)
        except LiveError as exc:
            self.param = exc.param
            raise
        self.session.active()

    async def act(self, event: ClientEvent) -> None:
        kind, message = event.kind, event.message
        if kind == "session.start":
            await self.start(message.get("session"))
        elif kind == "session.input_audio.append" and event.media is not None:
            await self.append_media(event.media)
        elif kind == "session.input_audio.append":
            await self.append_audio(message.get("audio"))
        elif kind in ("session.input_audio.mute", "session.input_audio.unmute"):
            self.muted = kind.endswith(".mute")
            self.send(self.answer({"type": "session.input_audio.muted" if self.muted
                                   else "session.input_audio.unmuted"}))
        elif kind == "session.update":
            await self.update(message.get("session"))
        elif kind in APPENDS:
            await self.append_text(kind, message)
        elif kind == "response.item.create":
            await self.item(message.get("item"))
        elif kind == "response.create":
            events = self.delegations.continue_waiting()
            if not events:
                raise LiveError("invalid_request", "no delegated response waits for tool "
                                "results: send response.item.create with a "
                                "function_call_output first")
            self.send_all(events)
        elif kind == "session.close":
            await self.close()

    def answer(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` naming the client event it answers (``client_event_id``)."""
        return {**payload, "client_event_id": self.event_id} if self.event_id else payload

    # --- the session -------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        config = self.config if self.config is not None else LiveConfig()
        out = config.describe(self.session_id, self.model_id, self.expires_at)
        if self.session.resume_token is not None:
            out["resume_token"] = self.session.resume_token
        return out

    def options(self, config: LiveConfig, appended: tuple[str, ...]) -> ConversationOptions:
        return session_options(self.limits, FIELDS,
                               system_prompt=system_prompt(config, appended),
                               tools=config.engine_tools(), turn_events=True)

    async def open_engine(self, config: LiveConfig, appended: tuple[str, ...]) -> None:
        options = self.options(config, appended)
        details = await self.session.open_session(options)
        self.delegations.model = (config.delegation.responses or {}).get("model", "")
        self.timeline = LiveTimeline(config.format, details.output_sample_rate,
                                     self.delegations, options.context_seconds)
        self.input = Resampler(config.format.rate, details.input_sample_rate)
        self.config, self.appended = config, appended

    async def start(self, payload: Any) -> None:
        if self.config is not None:
            raise LiveError("session_already_started", "session.start was already accepted; "
                            "use session.update")
        config = parse_start(payload)
        await self.open_engine(config, ())
        logger.info("%s started (GPT-Live, %s %d Hz, %d tools)", self.session_id,
                    config.format.type, config.format.rate, len(config.delegation.tools))
        self.send(self.answer({"type": "session.started", "session": self.describe()}))

    async def update(self, payload: Any) -> None:
        config = parse_update(self.config, payload)
        if config.engine_tools() != self.config.engine_tools():
            if self.session.heard_since_open:
                raise bad("session.delegation.responses.tools", "the tools are in the "
                          "model's prompt, which cannot change once it has heard audio")
            await self.open_engine(config, self.appended)
        self.config = config
        self.send(self.answer({"type": "session.updated", "session": self.describe()}))

    async def append_text(self, kind: str, message: dict[str, Any]) -> None:
        content = message.get("content")
        if not isinstance(content, str):
            raise missing("content")
        if len(content) > MAX_APPEND_CHARS:
            raise bad("content", f"{len(content)} characters; at most {MAX_APPEND_CHARS} "
                      "(about 500 tokens)")
        if "delegation_id" not in message:
            raise missing("delegation_id")
        if message["delegation_id"] is not None:
            raise bad("delegation_id", "delegation ids are not accepted with this session's "
                      "delegation; send null")
        if self.session.heard_since_open:
            raise LiveError("unsupported_after_audio", f"{kind}: this model takes text into "
                            "its context only before it hears audio (its prompt); after, "
                            "only as a delegation's result (response.item.create)")
        answer, form = APPENDS[kind]
        await self.open_engine(self.config, self.appended + (form.format(content),))
        self.send(self.answer({"type": answer, "start_ms": 0, "end_ms": 0}))

    async def item(self, item: Any) -> None:
        if not isinstance(item, dict):
            raise missing("item")
        if item.get("type") != "function_call_output":
            raise bad("item.type", "this model takes only a delegated call's result "
                      "('function_call_output')")
        strict_object(item, "item", ("type", "call_id", "output", "id", "status"))
        output = item.get("output")
        if not isinstance(output, str):
            raise missing("item.output")
        delegation = self.delegations.result_for(item.get("call_id"))
        try:
            await self.session.tool_output(delegation.call_id, output)
        except ProtocolError as exc:
            raise bad("item.output", exc.message) from None
        self.delegations.answered(delegation)

    # --- audio ----------------------------------------------------------------------

    async def append_audio(self, audio: Any) -> None:
        fmt = self.config.format
        if audio is None:
            raise missing("audio")
        try:
            data = decode_base64(audio, "base64")
        except ValueError as exc:
            raise bad("audio", str(exc)) from None
        width = 2 if fmt.type == PCM else 1
        cap = fmt.rate * width * MAX_APPEND_SECONDS
        if len(data) > cap:
            raise bad("audio", f"{len(data)} bytes of audio; one append carries at most "
                      f"{MAX_APPEND_SECONDS} s ({cap} bytes of {fmt.type} at {fmt.rate} Hz)")
        try:
            samples = decode(fmt, data)
        except FormatError as exc:
            raise bad("audio", str(exc)) from None
        if self.muted:  # a mute sends silence to the model
            samples = np.zeros_like(samples)
        await self.session.feed_audio(self.input(samples), sent=samples.shape[0])

    async def append_media(self, audio: AudioIn) -> None:
        """A media track's PCM16 (its format negotiated by WebRTC, not the session's)."""
        if self.config is None or self.input is None:
            return
        rate = self.session.details.input_sample_rate
        if self.media is None or self.media.in_rate != audio.sample_rate:
            self.media = Resampler(audio.sample_rate, rate)
        try:
            samples = pcm16_samples(audio.data, "media")
        except ValueError as exc:
            raise bad("audio", str(exc)) from None
        if self.muted:
            samples = np.zeros_like(samples)
        await self.session.feed_audio(self.media(samples), sent=samples.shape[0])

    # --- the end ----------------------------------------------------------------------

    def closed(self, reason: str) -> JsonOut:
        seconds = self.timeline.seconds if self.timeline is not None else 0.0
        return JsonOut({"type": "session.closed", "reason": reason,
                        "session": self.describe(), **usage(seconds, None)})

    async def close(self) -> None:
        """Drain the input's tail, run the frames, then ``session.closed``."""
        session = self.session
        if session.is_open and self.input is not None:
            await session.feed_audio(self.input(np.zeros(0, np.float32), last=True), sent=0)
            events = await session.flush()
            session.send_all(self.timeline.translate(events) + self.timeline.tail())
        closed = self.closed("close_requested").payload
        self.send(self.answer(closed))
        raise Finished(Ending.DONE)
