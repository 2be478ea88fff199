"""The OpenAI Realtime GA dialect (``/openai/v1/realtime``): a session, spoken as GA.

A GA client's ``base_url`` is ``http://HOST:PORT/openai/v1``. Admission, limits,
timeouts, origin policy, backpressure and tool results are every dialect's
(:mod:`...connection`, :mod:`...session`); the language is one :class:`GADialect` per
session (session object :mod:`.config`, responses :mod:`.responses`, items
:mod:`.items`, audio formats :mod:`.audio`):

- ``session.update`` may come any number of times and merges (GA clients
  send partial ones). The engine session opens at the first ``session.update``
  or the first audio. A change of ``instructions`` / ``tools`` /
  ``tool_choice`` reopens it (a new prefill); once audio has reached the
  model this restarts its timeline: the open response ends as ``cancelled``
  and what it heard before is forgotten. Audio formats and output modalities
  may change at any time.
- Audio arrives in the session's input format, resampled to 16 kHz;
  ``commit`` commits the user's item so far, ``clear`` drops the audio not yet
  resampled; neither ends the session. The model keeps listening until the
  client leaves (close 1000 is never needed).
- ``response.create`` / ``response.cancel`` / ``conversation.item.truncate``
  are accepted as described in :mod:`.responses`; a cancel or a truncate
  also cuts the speech a WebRTC track still holds (``output_audio_buffer.*``,
  and the client's ``output_audio_buffer.clear``: :mod:`.playback`).
- While a response is owed (opened or requested, not yet ``response.done``) and
  the client has sent no audio for :data:`STREAM_LULL_SECONDS` (at once after a
  commit with turn detection off), :meth:`GADialect.run_owed` runs the timeline on
  silence, a frame at a time behind the client's audio, as fast as the engine
  steps it, so the model can answer; ``max_response_seconds`` bounds the
  response, and the idle timeout does not run meanwhile.
- ``conversation.item.create`` answers a tool call with a ``function_call_output``;
  other items (a framework replaying its chat history) are acknowledged, not
  injected: the model hears only audio, and its text context is ``instructions``.
  Items are kept as their JSON bytes within ``--max-item-bytes``; a client's item
  past it is an ``invalid_request`` error and the session goes on.
- Audio from a media track (a WebRTC call, :class:`~...messages.AudioIn`) is an
  ``input_audio_buffer.append``, its 48 kHz resampled once, straight to the model's
  rate (:class:`.audio.MediaInput`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....runtime.options import ConversationOptions
from ....quoting import brief
from ...engine.pace import FramePace
from ...messages import AudioIn, AudioMark, Ending, Finished, JsonOut, Outgoing
from ...session.session import Session, stream_full
from ..client_options import session_options, transcription_options
from ...wire import (OFF_LOOP_CHARS, ErrorCode, ProtocolError, init_failed, invalid,
                    load_object, new_id, parse_tool_output)
from ..base import MODEL_INPUT_RATE, Dialect
from .audio import FormatError, InputAudio, MediaInput
from .config import GAConfig, error_event, merge_session, session_event
from .items import tool_output_item
from . import mcp_tools
from ...mcp.session_servers import SessionMcpServer, UrlRefused
from ....runtime.tool_failures import ToolFailure
from .playback import Playback
from .responses import GAResponses, outgoing
from .records import ItemStore, Out

logger = logging.getLogger(__name__)

REALTIME_PATH = "/openai/v1/realtime"
# A client that sent no audio for this long is not streaming: while a response is
# owed the server runs the timeline on silence (real-time clients send a chunk
# every 20-100 ms).
STREAM_LULL_SECONDS = 0.3
CLIENT_EVENTS = (
    "session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
    "input_audio_buffer.clear", "conversation.item.create", "conversation.item.truncate",
    "conversation.item.delete", "conversation.item.retrieve", "response.create",
    "response.cancel", "output_audio_buffer.clear",
)
# What an ephemeral key's minted session fixes for its connection (when it sets them).
PINNED = ("instructions", "tools", "tool_choice")
# The runtime's option -> the client's field, in error messages.
FIELDS = {"system_prompt": "session.instructions", "seed": "session.seed",
          "max_streaming_seconds": "session.max_streaming_seconds",
          "context_seconds": "session.context_seconds"}


@dataclass(frozen=True)
class ClientEvent:
    kind: str
    message: dict[str, Any]
    media: AudioIn | None = None  # an append's audio from a media track


class GADialect(Dialect):
    """One OpenAI Realtime GA client's session with the engine."""

    name = "openai-realtime-ga"
    paths = (REALTIME_PATH,)
    any_model = True  # GA clients ask for gpt-realtime by default: the served id answers
    binds_minted = True

    def __init__(self, session: Session, model_id: str):
        super().__init__(session, model_id)
        self.config = GAConfig()
        self.responses = GAResponses(self.config, max_item_bytes=self.limits.max_item_bytes)
        self.input = InputAudio(self.config.input_format, MODEL_INPUT_RATE)
        self.media = MediaInput(MODEL_INPUT_RATE)
        self.requested = self.options_of(self.config)  # the session options it asks for
        self.pinned: dict[str, Any] = {}  # field -> value an ephemeral key's session fixed
        self.opened_with: ConversationOptions | None = None  # the options of the open session
        self.mcp_servers: list[SessionMcpServer] = []  # the session's mcp tools, connected
        self.event_id: str | None = None  # of the client event being handled
        self.message_chars = 0  # its length
        self.last_audio = 0.0  # when the client's latest audio came (0: its turn ended)
        self.nudged = asyncio.Event()  # a client event or a frame: the owed state may change
        self.responses.session_pace = session.pace
        self.playback = Playback(lambda: self.plays_audio)  # a WebRTC track's playback
        session.keep_alive_while(self.owed)  # idle time does not count while a response is owed
        session.spawn(self.run_owed())

    # --- the dialect -----------------------------------------------------------

    def greeting(self) -> JsonOut:
        return JsonOut(session_event("session.created", self.session_id, self.model_id,
                                   self.config))

    def error(self, code: str, message: str) -> JsonOut:
        return JsonOut(error_event(code, message, self.event_id))

    @classmethod
    def refusal(cls, code: str, message: str) -> dict[str, Any]:
        return error_event(code, message)

    def received_audio(self) -> tuple[int, int]:
        return self.session.samples_received, self.input.format.rate

    def bind(self, session: dict[str, Any]) -> dict[str, Any]:
        """The minted session opens the connection; its ``instructions``, ``tools`` and
        ``tool_choice`` (those it sets) stay as the backend that minted the key set them."""
        minted = merge_session(GAConfig(), session)
        self.pinned = {name: getattr(minted, name) for name in PINNED if name in session}
        return {"type": "session.update", "session": session}

    def parse(self, message: str | bytes) -> ClientEvent:
        """One client message -> a GA client event; its ``event_id`` is echoed by its error."""
        self.event_id = None
        self.message_chars = len(message)
        message = load_object(self.text(message))
        event_id = message.get("event_id")
        self.event_id = event_id if isinstance(event_id, str) else None
        kind = message.get("type")
        if kind not in CLIENT_EVENTS:
            raise invalid(f"unsupported event type {brief(kind)}")
        return ClientEvent(kind, message)

    def audio_in(self, audio: AudioIn) -> ClientEvent:
        """Media audio: an ``input_audio_buffer.append`` of it."""
        self.event_id = None
        return ClientEvent("input_audio_buffer.append", {"type": "input_audio_buffer.append"},
                           audio)

    def queues_audio(self, event: ClientEvent) -> bool:
        # The responses' state follows the frames run so far: the audio queued
        # before any other event runs (and its events go out) first.
        return event.kind == "input_audio_buffer.append"

    def translate(self, events: list) -> list[Outgoing]:
        out = self.playback.follow(self.responses.translate(events))
        if self.responses.owes:
            self.nudged.set()
        return out

    def paced(self, pace: FramePace) -> None:
        self.responses.paced(pace)

    def frame_error(self, exc: BaseException) -> list[Outgoing]:
        """A frame's error; one of the server's silence frames failing (not at the
        stream's bound) ends the owed response as ``failed`` (the session stays)."""
        out = super().frame_error(exc)
        if self.responses.server_frames and not stream_full(exc):
            out += self.playback.follow(outgoing(self.responses.fail(str(exc)
                                                                      or type(exc).__name__)))
        return out

    def limit_reached(self) -> None:
        """The stream is full: the conversation ends normally."""
        self.session.halt(Finished(Ending.DONE))

    def emit(self, out: Out) -> None:
        """Events of the responses' book (audio apart), sent in order."""
        self.session.send_all(self.playback.follow(outgoing(out)))

    def played(self, mark: AudioMark) -> None:
        self.session.send_all(self.playback.played(mark))

    async def dispatch(self, event: ClientEvent) -> None:
        try:
            await self.act(event)
        finally:
            self.nudged.set()

    async def act(self, event: ClientEvent) -> None:
        kind, message, session = event.kind, event.message, self.session
        if kind == "session.update":
            await self.update(message.get("session"))
        elif kind == "input_audio_buffer.append":
            await self.append_audio(message.get("audio"), event.media)
        elif kind == "input_audio_buffer.commit":
            if not session.is_open and self.config.turn_detection is None:
                # the response owed needs a timeline
                await self.open_engine(self.config, self.requested)
            self.emit(self.responses.commit())
            if self.config.turn_detection is None:
                self.last_audio = 0.0  # push-to-talk: the user's turn ended, answer now
        elif kind == "input_audio_buffer.clear":
            self.input = InputAudio(self.config.input_format, MODEL_INPUT_RATE)
            self.media = MediaInput(MODEL_INPUT_RATE)
            self.send({"type": "input_audio_buffer.cleared"})
        elif kind == "conversation.item.create":
            await self.create_item(message.get("item"))
        elif kind == "conversation.item.truncate":
            await self.truncate(message)
        elif kind == "conversation.item.delete":
            self.send(self.responses.delete(message.get("item_id")))
        elif kind == "conversation.item.retrieve":
            self.send(self.responses.retrieve(message.get("item_id")))
        elif kind == "response.create":
            await self.create_response(message.get("response"))
        elif kind == "output_audio_buffer.clear":
            if not self.plays_audio:
                raise invalid("output_audio_buffer.clear is for WebRTC calls, where the server "
                              "plays the audio; a WebSocket client drops its own")
            self.session.send_all(self.playback.clear(asked=True))
        elif kind == "response.cancel":
            self.session.send_all(self.playback.clear())  # the speech queued is cut too
            events = self.responses.cancel()
            if events is None:
                raise ProtocolError("response_cancel_not_active",
                                    "there is no active response to cancel")
            self.emit(events)
            if self.session.server_tools is not None:  # barge-in: its calls in flight too
                self.session.server_tools.cancel_all("the response was cancelled", tell=True)
        session.active()

    async def create_response(self, params: Any) -> None:
        if self.config.output_modalities == ("text",):
            raise invalid("a session with output_modalities ['text'] transcribes the user "
                          "only and makes no responses")
        if not self.session.is_open:
            await self.open_engine(self.config, self.requested)
        events = self.responses.request(params)
        if events is None:
            active = self.responses.active_response_id
            if active is None:
                raise invalid("the stream has ended (max_streaming_seconds): no more responses")
            raise ProtocolError("conversation_already_has_active_response",
                                f"the conversation already has an active response {active} "
                                "and a response.create waiting for it; wait for its "
                                "response.done")
        self.emit(events)

    # --- session ----------------------------------------------------------

    def options_of(self, config: GAConfig) -> ConversationOptions:
        """The engine session's options ``config`` asks for (built, and so checked, here)."""
        return session_options(self.limits, FIELDS, system_prompt=config.system_prompt,
                               seed=config.seed, tools=config.engine_tools(),
                               max_streaming_seconds=config.max_streaming_seconds,
                               context_seconds=config.context_seconds, turn_events=True)

    async def update(self, payload: Any) -> None:
        config = merge_session(self.config, payload)
        for name, value in self.pinned.items():
            if getattr(config, name) != value:
                raise init_failed(f"session.{name} was fixed when this connection's "
                                  "ephemeral key was minted (client_secrets); it cannot change")
        servers = mcp_tools.parse_mcp_tools(config.tools)
        options = self.options_of(config)
        if servers != self.mcp_servers:  # their tools are prefilled: the stream opens again
            await self.connect_mcp(servers)
            self.opened_with = None
        if self.opened_with != options:
            if self.session.heard_since_open:
                # The prompt and tools are prefilled: a new timeline starts, and
                # what the model heard so far is forgotten (GA clients often send
                # their tools while audio already flows).
                logger.warning("%s instructions/tools changed after %d frames run: the "
                               "model's timeline restarts", self.session_id,
                               self.session.frames_run)
                self.emit(self.responses.restart())
            await self.open_engine(config, options)
        if config.input_format != self.config.input_format:
            self.input = InputAudio(config.input_format, MODEL_INPUT_RATE)
        self.config, self.requested = config, options
        self.responses.configure(config)
        self.send(session_event("session.updated", self.session_id, self.model_id, config))

    async def connect_mcp(self, servers: list[SessionMcpServer]) -> None:
        """Connect the session's ``mcp`` tools (the ones before disconnected), each listed
        as GA lists them; one refused or down is ``mcp_list_tools.failed`` and an error,
        and the session goes on without its tools."""
        tools = self.session.server_tools
        if tools is not None:
            await tools.close_own()
        self.mcp_servers = servers
        for server in servers:
            item_id, out = mcp_tools.listing_started(self.responses, server)
            self.emit(out)
            try:
                if tools is None:
                    raise UrlRefused("this server lets no session name an MCP server "
                                     "(the operator's --mcp-allow-url)")
                listed = await tools.connect_own(server)
            except (UrlRefused, ToolFailure) as exc:
                message = f"MCP server {server.label}: {exc}"
                logger.info("%s %s", self.session_id, message)
                self.emit([{"type": "mcp_list_tools.failed", "item_id": item_id}])
                self.send(error_event("mcp_list_tools_failed", message, None))
                continue
            self.emit(mcp_tools.listing_done(self.responses, item_id, server, listed))

    async def open_engine(self, config: GAConfig, options: ConversationOptions) -> None:
        """Open (or reopen) the engine session for ``config`` with its ``options``."""
        text_only = config.output_modalities == ("text",)
        if text_only and options.tools is not None:
            raise init_failed("session.output_modalities ['text'] transcribes the user only; "
                              "tools need ['audio']")
        self.opened_with = None
        # Transcription only (perception + RNNT): the user transcript, no responses.
        opened = transcription_options(self.limits, options) if text_only else options
        details = await self.session.open_session(opened)
        self.opened_with = options
        self.responses.configure(config, details.output_sample_rate,
                                 details.frame_samples / details.input_sample_rate)
        logger.info("%s configured (GA, seed %d, max %.1f s)", self.session_id, options.seed,
                    options.max_streaming_seconds)

    # --- audio ------------------------------------------------------------

    async def append_audio(self, audio: Any, media: AudioIn | None = None) -> None:
        if not self.session.is_open:
            await self.open_engine(self.config, self.requested)
        try:
            if media is None:
                taken = self.input.decode(audio)
                samples, sent = self.input.resample(taken), taken.shape[0]
            else:
                samples, sent = self.media.decode(media.data, media.sample_rate)
        except FormatError as exc:
            raise invalid(str(exc)) from None
        if samples.shape[0]:
            self.last_audio = time.monotonic()
        await self.session.feed_audio(samples, sent=sent)

    async def push_frame(self, chunk: np.ndarray) -> None:
        """One frame of server-made input, queued behind the client's audio (the same
        session channel); waits for it to run. Its events and its error go out as any
        frame's (:meth:`frame_error`; a full stream ends the conversation)."""
        await self.session.push(chunk)

    # --- owed responses: the timeline runs on silence -------------------------

    def owed(self) -> bool:
        return self.session.is_open and self.responses.owes

    async def run_owed(self) -> None:
        """The session's timer (on the loop, with or without a transport): while a
        response is owed and the client has sent no audio for
        :data:`STREAM_LULL_SECONDS`, silence frames run, one at a time, between the
        client's events (the idle clock stands still meanwhile). While the session is
        detached nothing runs: no silence is invented while nobody listens."""
        session = self.session
        while True:
            if not session.linked.is_set():  # detached: the timeline pauses
                await session.linked.wait()
                continue
            if not self.owed():
                self.nudged.clear()
                await self.nudged.wait()
                continue
            lull = self.last_audio + STREAM_LULL_SECONDS - time.monotonic()
            if lull > 0:
                self.nudged.clear()
                try:  # new audio moves the lull
                    await asyncio.wait_for(self.nudged.wait(), lull)
                except asyncio.TimeoutError:
                    pass
                continue
            async with session.acting:  # audio may have come while the lock was awaited
                if self.owed() and time.monotonic() >= self.last_audio + STREAM_LULL_SECONDS:
                    session.active()
                    await self.continue_on_silence()
                    session.active()  # the idle clock starts when the response ends

    async def continue_on_silence(self) -> None:
        """One frame of silence for the model to answer in; an engine failure ends
        the owed response as ``failed`` (the session stays)."""
        self.responses.server_frames = True
        try:
            await self.push_frame(np.zeros(self.session.details.frame_samples, np.float32))
        except ProtocolError as exc:
            self.session.send(self.error(exc.code, exc.message))
            self.emit(self.responses.fail(exc.message))
        finally:
            self.responses.server_frames = False

    # --- items ------------------------------------------------------------

    async def create_item(self, item: Any) -> None:
        if isinstance(item, dict) and item.get("type") == "mcp_approval_response":
            echoed, request_id, approve = mcp_tools.approval_response(item)
            tools = self.session.server_tools
            try:
                if tools is None:
                    raise ValueError(f"no approval request {request_id!r} is waiting")
                tools.approve(request_id, approve)
            except ValueError as exc:
                raise invalid(str(exc)) from None
            self.emit(self.responses.item_added(echoed))
            return
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            output = parse_tool_output(item)
            if not self.session.is_open:
                raise ProtocolError(ErrorCode.TOOLS_NOT_SET, "function_call_output needs tools "
                                    "registered in session.update")
            call_id = self.responses.runtime_call_id(output.call_id)
            echo = tool_output_item(item)
            events = self.responses.item_added(echo, await self.encoded(echo))
            try:
                await self.session.tool_output(call_id, output.output)
            except BaseException:
                self.responses.items.pop(echo["id"])
                raise
            self.emit(events)
            return
        if not isinstance(item, dict) or item.get("type") not in ("message", "function_call"):
            raise invalid("conversation.item.create supports items of type message, "
                          "function_call and function_call_output")
        logger.info("%s %s item acknowledged, not injected (the model hears only audio)",
                    self.session_id, item.get("type"))
        known = {key: item[key] for key in ("type", "role", "content", "call_id", "name",
                                            "arguments") if key in item}
        added = {"id": item["id"] if isinstance(item.get("id"), str) else new_id("item"),
                 "object": "realtime.item", "status": "completed", **known}
        self.emit(self.responses.item_added(added, await self.encoded(added)))

    async def encoded(self, item: dict[str, Any]) -> bytes:
        """``item``'s JSON as kept (a long one made in a worker thread, off the loop);
        refused past ``--max-item-bytes``."""
        if self.message_chars > OFF_LOOP_CHARS:
            return await asyncio.to_thread(ItemStore.encode, item)
        return ItemStore.encode(item)

    async def truncate(self, message: dict[str, Any]) -> None:
        item_id, index, end = (message.get("item_id"), message.get("content_index", 0),
                               message.get("audio_end_ms"))
        if not isinstance(item_id, str):
            raise invalid("item_id must be a string")
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise invalid("audio_end_ms must be a non-negative integer")
        if self.playback.holds(item_id):  # its speech still queued on the track: cut
            self.session.send_all(self.playback.clear())
        events = self.responses.truncate(item_id)
        if events is None:  # OpenAI's error for an item it does not hold
            raise ProtocolError("item_truncate_invalid_item_id", "Error truncating item: the "
                                f"item with id {item_id[:64]!r} does not exist.")
        self.emit(events)
        self.send({"type": "conversation.item.truncated", "item_id": item_id,
                         "content_index": index, "audio_end_ms": end})


