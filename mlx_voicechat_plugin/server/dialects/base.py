"""What a wire dialect is: the client's messages read, acted on, and the runtime's events told.

A :class:`Dialect` subclass is one wire language (mlx-vlm's, OpenAI Realtime
GA's); one instance serves one :class:`~..session.session.Session` and holds the
dialect's state of it (a GA session's responses, its audio formats), so the
state lives as long as the session, through any number of transports. It
runs on the event loop.

It reads a client message (text or binary, :meth:`~Dialect.parse`), acts on
the session (:meth:`~Dialect.dispatch`: open it, feed it audio, answer), and
translates runtime events into typed messages (:meth:`~Dialect.translate`):
:class:`~..messages.JsonOut` objects, and :class:`~..messages.AudioOut` for
audio, which a transport carries inside the event or on a track of its own.
It makes no JSON text, knows no transport and ends a conversation by raising
:class:`~..messages.Finished` with the :class:`~..messages.Ending` (why, not
how: the transport picks its close code).

The app serves a dialect class at its :attr:`~Dialect.paths` (under
``--api-prefix``); :attr:`~Dialect.name` names its route.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from ..engine.pace import FramePace
from ..messages import AudioIn, AudioMark, Ending, Finished, JsonOut, Outgoing
from ..session.session import Session, stream_full
from ..wire import ErrorCode, ProtocolError, invalid

logger = logging.getLogger(__name__)

BINARY_REFUSED = "binary frames are not supported; send JSON text"
MODEL_INPUT_RATE = 16_000  # the model's input rate (before a session has opened)
MEDIA_REFUSED = "this protocol takes no audio on a media track"


class Dialect:
    """One session's dialect: the hooks below, and the services every dialect shares."""

    name: ClassVar[str]
    paths: ClassVar[tuple[str, ...]]
    query_key: ClassVar[bool] = False  # the API key may also come as ``?api_key=``
    health: ClassVar[bool] = False  # ``GET <path>/health`` reports the engine's readiness
    # ``?model=`` may name any model (reported as the served id) unless ``--strict-model``.
    any_model: ClassVar[bool] = False
    # Takes an ephemeral key's minted session (:meth:`bind`); a key minted with one opens
    # no other dialect.
    binds_minted: ClassVar[bool] = False
    # Whether the session's transport plays the model's audio itself (a WebRTC track):
    # the connection sets it from its transport; what the dialect tells of that
    # playback (GA's ``output_audio_buffer.*``) is said only then.
    plays_audio = False

    def __init__(self, session: Session, model_id: str):
        self.session = session
        self.model_id = model_id
        self.limits = session.limits
        self.failed_updates = 0  # session.update messages the session refused

    # --- the hooks ------------------------------------------------------------------

    def greeting(self) -> JsonOut:
        """The first event, sent once the session is admitted."""
        raise NotImplementedError

    def greet(self) -> JsonOut:
        """:meth:`greeting`, its session object carrying ``resume_token`` when the
        session is resumable (the same field in every dialect)."""
        greeting = self.greeting()
        token, inner = self.session.resume_token, greeting.payload.get("session")
        if token is None or not isinstance(inner, dict):
            return greeting
        return JsonOut({**greeting.payload, "session": {**inner, "resume_token": token}})

    def refused(self, error: ProtocolError) -> None:
        """A client message was refused with ``error`` (its error event is out). By
        default, ``--max-failed-updates`` failed ``session.update`` messages end the
        conversation (close for a violation): a client cannot retry one forever."""
        if error.code != ErrorCode.SESSION_INITIALIZATION_FAILED:
            return
        self.failed_updates += 1
        if self.failed_updates >= self.limits.max_failed_updates:
            message = f"{self.failed_updates} failed session.update messages; closing"
            self.send_error(ErrorCode.INVALID_REQUEST, message)
            raise Finished(Ending.VIOLATION)

    def error(self, code: str, message: str) -> JsonOut:
        """The dialect's error event for ``code`` (an :class:`~..wire.ErrorCode`)."""
        raise NotImplementedError

    @classmethod
    def wire_code(cls, code: str) -> str:
        """The code a client reads for ``code`` in :meth:`error`'s event and in a
        :meth:`refusal` (the server's own unless the protocol names it otherwise); what
        the server logs."""
        return code

    def log_error(self, code: str, message: str) -> None:
        """Log an error the client is sent, under the code it reads (:meth:`wire_code`)."""
        logger.info("%s error %s: %s", self.session_id, self.wire_code(code), message)

    def send_error(self, code: str, message: str) -> None:
        """Send :meth:`error`'s event, logged once (:meth:`log_error`)."""
        self.log_error(code, message)
        self.session.send(self.error(code, message))

    @classmethod
    def refusal(cls, code: str, message: str) -> dict[str, Any]:
        """The body of an HTTP refusal of an upgrade at this dialect's path (a resume
        refused), in the dialect's error shape; by default ``{"type": "error", "error":
        {"code", "message"}}``."""
        return {"type": "error", "error": {"code": code, "message": message}}

    def timed_out(self, reason: str) -> JsonOut:
        """The error event when a session deadline passes (no update, idle, the wall
        clock; ``reason`` says which); by default ``invalid_request``."""
        return self.error(ErrorCode.INVALID_REQUEST, reason)

    def resumed(self, last_seq: int, replayed: int) -> JsonOut:
        """The first event on a resumed session's new transport (it carries no ``seq``:
        it is the transport's, never replayed): how much of the client's audio the
        server holds (:meth:`received_audio`), so the client resends from there, and how
        many events follow as the replay, those after ``last_seq``."""
        samples, rate = self.received_audio()
        return JsonOut({"type": "session.resumed",
                      "session": {"id": self.session_id,
                                  "resume_token": self.session.resume_token},
                      "last_seq": last_seq, "replayed": replayed,
                      "audio_received_samples": samples, "audio_sample_rate": rate})

    def received_audio(self) -> tuple[int, int]:
        """The client's audio the session took: samples, at the rate the client sends."""
        details = self.session.details
        return self.session.samples_received, (details.input_sample_rate if details
                                               else MODEL_INPUT_RATE)

    def bind(self, session: dict[str, Any]) -> dict[str, Any]:
        """Bind the connection to an ephemeral key's minted ``session``: the message that
        opens it (handled first, as if the client sent it); what it fixed stays fixed."""
        raise NotImplementedError

    def parse(self, message: str | bytes) -> Any:
        """One client message -> the dialect's message (:class:`~..wire.ProtocolError`
        if bad)."""
        raise NotImplementedError

    def audio_in(self, audio: AudioIn) -> Any:
        """Audio from a media track (WebRTC) -> the dialect's message that carries it, as
        :meth:`parse` would make it; by default refused."""
        raise invalid(MEDIA_REFUSED)

    def played(self, mark: AudioMark) -> None:
        """The transport's playback reached ``mark`` (one the dialect sent); by default
        nothing is said."""

    def queues_audio(self, message: Any) -> bool:
        """Whether ``message`` carries audio: queued, not awaited; anything else is
        answered after the audio queued before it has run (:meth:`Session.settle`)."""
        raise NotImplementedError

    async def dispatch(self, message: Any) -> None:
        """Act on one message; raise :class:`~..messages.Finished` to end the conversation."""
        raise NotImplementedError

    def translate(self, events: list) -> list[Outgoing]:
        """One frame's (or a command's) runtime events as the messages sent, in order."""
        raise NotImplementedError

    def frame_error(self, exc: BaseException) -> list[Outgoing]:
        """A queued frame failed: its ``inference_error``; at ``max_streaming_seconds``
        :meth:`limit_reached` decides what follows."""
        out: list[Outgoing] = [self.error(ErrorCode.INFERENCE_ERROR,
                                          str(exc) or type(exc).__name__)]
        if stream_full(exc):
            self.limit_reached()
        return out

    def paced(self, pace: FramePace) -> None:
        """How late the frames of the hand-off about to be translated ran (the session
        sums them in :attr:`~..session.session.Session.pace`); by default not told."""

    def limit_reached(self) -> None:
        """A frame failed at ``max_streaming_seconds`` (its error goes out); by default
        the conversation goes on (the client ends the stream)."""

    # --- shared services ---------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @staticmethod
    def text(message: str | bytes) -> str:
        """A JSON dialect's text message; a binary frame is an ``invalid_request``."""
        if not isinstance(message, str):
            raise invalid(BINARY_REFUSED)
        return message

    def send(self, payload: dict[str, Any]) -> None:
        """One control event to the client (through the session, in order)."""
        self.session.send(JsonOut(payload))

    def send_all(self, payloads: list[dict[str, Any]]) -> None:
        for payload in payloads:
            self.send(payload)

    def forward(self, events: list) -> None:
        """Runtime events an engine command replied with (a commit's, a cancel's), sent."""
        self.session.send_all(self.translate(events))
