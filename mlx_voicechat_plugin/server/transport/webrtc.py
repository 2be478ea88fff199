"""The WebRTC transport: a call's events on its ``oai-events`` data channel, audio on tracks.

A :class:`WebRTCTransport` is one aiortc ``RTCPeerConnection`` as the
connection sees it, on the event loop. :meth:`~WebRTCTransport.answer` takes
the client's SDP offer and makes the answer (candidates gathered as
:class:`~.ice.ICEConfig` says). Then:

- in: each text (or binary) message on the data channel the client opened
  named :data:`EVENTS_CHANNEL`, and the client's audio track decoded to
  PCM16 (:mod:`.rtc_media`) as :class:`~..messages.AudioIn`, queued audio
  handed over joined; audio the connection has not taken past
  :data:`MAX_AUDIO_BACKLOG` frames is dropped (media cannot wait), the
  messages are handed over no faster than the ``read_rate`` (the WebSocket
  transport's :class:`~.websocket.ReadRate`: a message past the budget waits
  until it has refilled), and more than ``max_pending`` unread messages, or
  ``max_pending_bytes`` of them, end the call;
- out: each :class:`~..messages.JsonOut` as JSON text on the data channel
  (queued until the channel opens); more than ``max_pending`` events waiting
  for it, or ``max_pending_bytes`` unsent (queued or buffered on the
  channel), end the call as a client not reading; an
  :class:`~..messages.AudioOut`'s audio on the call's audio track
  (:class:`~.rtc_media.SpeechTrack`), and its event, which only carries it,
  not at all; the transport plays the audio itself (:attr:`plays_audio`): a
  :class:`~..messages.ClearAudio` drops the speech queued on the track (a
  barge-in), an :class:`~..messages.AudioMark` comes back from
  :meth:`~WebRTCTransport.receive` once the track has sent the speech before it;
- the end: the peer connection failing or closing, the data channel
  closing, or :meth:`~WebRTCTransport.hang_up` (the route's ``DELETE``) is a
  :class:`~..messages.Hangup`; :meth:`~WebRTCTransport.stop` closes the peer
  connection, whatever the :class:`~..messages.Ending` (a call has no close
  code), and tells ``on_end``.

It knows no dialect: what a message means is the dialect's business.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Callable, Union

from aiortc import RTCPeerConnection, RTCSessionDescription

from ..messages import (AudioIn, AudioMark, AudioOut, ClearAudio, ClientNotReading, Ending,
                        Hangup, Outgoing)
from .ice import ICEConfig, quick_consent
from .outbox import frame_bytes
from .rtc_media import RATE, SpeechTrack, read_track
from .websocket import ReadRate, serialize

logger = logging.getLogger(__name__)

EVENTS_CHANNEL = "oai-events"  # the data channel a client opens for the events (OpenAI's name)
MAX_AUDIO_BACKLOG = 100  # 20 ms frames (2 s) waiting for the connection before dropping
ENDED_STATES = ("failed", "closed")

Received = Union[str, bytes, AudioIn, AudioMark, Hangup]


# m-sections an offer may have: a call uses its audio and its data channel; a
# browser may offer a few more (video, a second track), which are declined.
MAX_M_SECTIONS = 8


def message_bytes(message: str | bytes) -> int:
    """A data channel message's size: a text message's UTF-8 bytes, as it came."""
    return len(message) if isinstance(message, bytes) else frame_bytes(message)


class OfferError(ValueError):
    """The client's SDP offer cannot be answered (malformed, or without audio)."""


def check_offer(sdp: str) -> None:
    """An offer this server can answer: SDP text with an audio m-line."""
    lines = [line.strip() for line in sdp.splitlines()]
    if not lines or lines[0] != "v=0":
        raise OfferError("the SDP offer must begin with 'v=0'")
    if not any(line.startswith("m=audio ") for line in lines):
        raise OfferError("the SDP offer has no audio m-line (m=audio): a call needs the "
                         "client's microphone track")
    sections = sum(line.startswith("m=") for line in lines)
    if sections > MAX_M_SECTIONS:
        raise OfferError(f"the SDP offer has {sections} m-sections; a call takes at most "
                         f"{MAX_M_SECTIONS} (its audio and its events' data channel)")


class WebRTCTransport:
    """One call's peer connection, as the connection sees it."""

    plays_audio = True  # the model's audio is paced onto a track here, not by the client
    joins_audio = True  # a receive takes the track's audio queued by then, as one chunk

    def __init__(self, max_pending: int, send_timeout: float,
                 on_end: Callable[[], None] | None = None, *, max_pending_bytes: int,
                 read_rate: ReadRate | None = None):
        self.max_pending = max_pending
        self.read_rate = read_rate
        self.max_pending_bytes = max_pending_bytes
        self.send_timeout = send_timeout
        self.on_end = on_end
        self.pc: Any = None
        self.inbox: deque[Received] = deque()
        self.arrived = asyncio.Event()
        self.messages = 0  # text/binary messages in the inbox
        self.unread_bytes = 0  # their sizes (:func:`message_bytes`)
        self.audio_frames = 0  # AudioIn in the inbox
        self.dropped = 0  # audio frames dropped: the connection was not taking them
        self.channel: Any = None
        self.unsent: deque[str] = deque()  # events made before the data channel opened
        self.unsent_bytes = 0
        self.speech = SpeechTrack(on_mark=self._put)
        self.reader: asyncio.Task | None = None
        self.stopped = False

    # --- signaling -----------------------------------------------------------------

    async def answer(self, offer: str, ice: ICEConfig) -> str:
        """The SDP answer to ``offer`` (:class:`OfferError` when it cannot be answered)."""
        check_offer(offer)
        quick_consent()  # a peer that vanished (a killed tab) ends its call within seconds
        self.pc = pc = RTCPeerConnection(ice.rtc_configuration())
        pc.on("datachannel", self._on_channel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", self._on_state)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(offer, "offer"))
        except Exception as exc:  # aiortc's parser raises what it meets
            raise OfferError(f"malformed SDP offer: {str(exc)[:200] or type(exc).__name__}") \
                from None
        pc.addTrack(self.speech)
        try:
            with ice.gathering():
                await pc.setLocalDescription(await pc.createAnswer())
        except Exception as exc:  # an offer aiortc took but cannot answer
            raise OfferError(f"the SDP offer cannot be answered: "
                             f"{str(exc)[:200] or type(exc).__name__}") from None
        return pc.localDescription.sdp

    def _on_channel(self, channel: Any) -> None:
        if channel.label != EVENTS_CHANNEL or self.channel is not None:
            logger.info("ignored data channel %r (events go on %r)", channel.label[:64],
                        EVENTS_CHANNEL)
            return
        self.channel = channel
        channel.on("message", self._on_message)
        channel.on("close", self.hang_up)
        if channel.readyState == "open":
            self._flush()
        else:
            channel.on("open", self._flush)

    def _on_track(self, track: Any) -> None:
        if track.kind == "audio" and self.reader is None:
            self.reader = asyncio.ensure_future(read_track(track, self._on_audio))

    def _on_state(self) -> None:
        if self.pc is not None and self.pc.connectionState in ENDED_STATES:
            self.hang_up()

    # --- in ------------------------------------------------------------------------

    def _put(self, item: Received) -> None:
        self.inbox.append(item)
        self.arrived.set()

    def _on_message(self, message: str | bytes) -> None:
        size = message_bytes(message)
        if self.messages >= self.max_pending or \
                self.unread_bytes + size > self.max_pending_bytes:
            logger.warning("call closed: %d data channel messages (%d bytes) unread",
                           self.messages, self.unread_bytes)
            self.hang_up()
            return
        self.messages += 1
        self.unread_bytes += size
        self._put(message)

    def _on_audio(self, audio: AudioIn) -> None:
        if self.audio_frames >= MAX_AUDIO_BACKLOG:
            if not self.dropped:
                logger.warning("dropping client audio: %d frames wait for the session",
                               self.audio_frames)
            self.dropped += 1
            return
        self.audio_frames += 1
        self._put(audio)

    def inject(self, message: str) -> None:
        """A message handled as if the client had sent it first (the call's session)."""
        self.messages += 1
        self.unread_bytes += message_bytes(message)
        self._put(message)

    def hang_up(self) -> None:
        """The client's end of the call (the route's hang-up, the peer gone)."""
        self._put(Hangup())

    async def accept(self) -> None:
        """Nothing to accept: the call was answered at signaling."""

    async def receive(self) -> Received:
        """The next data channel message, the audio queued now (joined), a mark the track
        reached, or :class:`Hangup`."""
        while not self.inbox:
            self.arrived.clear()
            await self.arrived.wait()
        item = self.inbox.popleft()
        if isinstance(item, Hangup):
            self.inbox.appendleft(item)  # every later receive says so too
            return item
        if isinstance(item, AudioMark):
            return item
        if not isinstance(item, AudioIn):
            size = message_bytes(item)
            self.messages -= 1
            self.unread_bytes -= size
            if self.read_rate is not None:
                wait = self.read_rate.wait_for(size)
                if wait:
                    await asyncio.sleep(wait)
            return item
        parts = [item.data]
        while self.inbox and isinstance(self.inbox[0], AudioIn) \
                and self.inbox[0].sample_rate == item.sample_rate:
            parts.append(self.inbox.popleft().data)
        self.audio_frames -= len(parts)
        return AudioIn(b"".join(parts), item.sample_rate) if len(parts) > 1 else item

    # --- out -----------------------------------------------------------------------

    def promise(self, messages: list[Outgoing]) -> None:
        """A resume's replay (a call is never resumed: sent as any event)."""
        for message in messages:
            self.send(message)

    def send(self, message: Outgoing) -> None:
        """An event onto the data channel, audio onto the track (:class:`ClientNotReading`
        when the client does not take them)."""
        if self.stopped:
            raise ClientNotReading("the call has ended")
        if isinstance(message, AudioOut):
            self.speech.put(message.data, message.encoding, message.sample_rate)
            return
        if isinstance(message, ClearAudio):
            dropped = self.speech.clear()
            logger.debug("cleared %.2f s of queued speech", dropped / RATE)
            return
        if isinstance(message, AudioMark):
            self.speech.mark(message)
            return
        text = serialize(message)
        channel = self.channel
        waiting = self.unsent_bytes + (channel.bufferedAmount if channel is not None else 0)
        if waiting >= self.max_pending_bytes:
            raise ClientNotReading(f"{waiting} bytes of events wait on the data channel")
        if channel is None or channel.readyState != "open" or self.unsent:
            if len(self.unsent) >= self.max_pending:
                raise ClientNotReading(f"{len(self.unsent)} events wait for the data channel")
            self.unsent.append(text)
            self.unsent_bytes += frame_bytes(text)
            return
        channel.send(text)

    def _flush(self) -> None:
        while self.unsent and self.channel.readyState == "open":
            text = self.unsent.popleft()
            self.unsent_bytes -= frame_bytes(text)
            self.channel.send(text)

    async def drain(self) -> bool:
        """Let the queued events go out; ``False`` if they took past the send timeout."""
        channel = self.channel
        if channel is None or channel.readyState != "open":
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.send_timeout
        while channel.bufferedAmount and channel.readyState == "open":
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def stop(self) -> None:
        """End the call: the peer connection closed (once), ``on_end`` told."""
        if self.stopped:
            return
        self.stopped = True
        if self.reader is not None:
            self.reader.cancel()
        self.speech.stop()
        try:
            if self.pc is not None:
                await self.pc.close()
        except Exception:
            logger.exception("closing a peer connection failed")
        finally:
            if self.on_end is not None:
                self.on_end()

    async def close(self, ending: Ending, reason: str = "") -> None:
        """A call has no close code: the peer connection closes whatever ``ending`` is."""
        logger.info("call closed (%s%s)", ending.value, f": {reason}" if reason else "")
        await self.stop()
