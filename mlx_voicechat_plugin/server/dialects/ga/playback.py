"""The model's audio as a transport that plays it itself plays it: GA's WebRTC-only events.

Over a WebRTC call the server, not the client, plays the responses' audio
(paced on the call's track), so OpenAI's WebRTC server tells the client
where that playback is, on the data channel:

- ``output_audio_buffer.started`` (``response_id``): a response's audio
  begins to stream to the client (after its ``response.content_part.added``);
- ``output_audio_buffer.stopped``: the response's audio has all been played
  out and no more is coming (after its ``response.done``);
- ``output_audio_buffer.cleared``: the audio queued unplayed was dropped: at
  the client's ``output_audio_buffer.clear`` (WebRTC only), and here also at a
  ``response.cancel`` or ``conversation.item.truncate`` that cuts the speech
  still queued (a barge-in).

:class:`Playback` follows one session's outgoing messages: when the
connection says its transport plays the audio (``Dialect.plays_audio``) it
adds those events, puts an :class:`~..messages.AudioMark` after each
response's audio (the transport hands it back when its track has sent that
audio: ``stopped``), and a cut sends :class:`~..messages.ClearAudio` (the
track drops its queue) and drops what is left of the cut responses' audio.
Over a WebSocket (the client plays what it reads) it adds nothing: a cut is
a :class:`~..messages.ClearAudio` that transport ignores.
"""

from __future__ import annotations

from typing import Callable

from ...messages import AudioMark, AudioOut, ClearAudio, JsonOut, Outgoing


class Playback:
    """One GA session's responses with audio queued on a transport that plays it."""

    def __init__(self, plays: Callable[[], bool]):
        self.plays = plays  # whether the transport plays the audio (the dialect's flag)
        self.queued: dict[str, str | None] = {}  # response id -> its item, started, not done
        self.cut: set[str] = set()  # responses cut, not yet done: their audio is dropped
        self.last: str | None = None  # the latest response that sent audio

    def follow(self, messages: list[Outgoing]) -> list[Outgoing]:
        """``messages`` as sent: ``started`` before a response's first audio, a mark
        after its ``response.done``; the audio of a cut response left out."""
        if not self.plays():
            return messages
        out: list[Outgoing] = []
        for message in messages:
            if isinstance(message, AudioOut):
                response = message.event.get("response_id")
                if response in self.cut:
                    continue
                if response not in self.queued:
                    self.queued[response] = message.event.get("item_id")
                    self.last = response
                    out.append(JsonOut({"type": "output_audio_buffer.started",
                                      "response_id": response}))
            out.append(message)
            if isinstance(message, JsonOut) and message.payload.get("type") == "response.done":
                response = message.payload.get("response", {}).get("id")
                self.cut.discard(response)  # no audio of it follows its done
                if response in self.queued:
                    out.append(AudioMark(response))
        return out

    def played(self, mark: AudioMark) -> list[Outgoing]:
        """The track has sent the audio of ``mark``'s response: ``stopped``."""
        if self.queued.pop(mark.name, False) is False:
            return []
        return [JsonOut({"type": "output_audio_buffer.stopped", "response_id": mark.name})]

    def holds(self, item_id: str) -> bool:
        """Whether the audio of the response with item ``item_id`` is still queued."""
        return item_id in self.queued.values()

    def clear(self, asked: bool = False) -> list[Outgoing]:
        """Cut the speech queued: :class:`ClearAudio`, and where the transport plays it
        ``cleared`` for each response it held (``asked``: the client's
        ``output_audio_buffer.clear``, answered even when nothing was queued, once a
        response has played)."""
        out: list[Outgoing] = [ClearAudio()]
        if not self.plays():
            return out
        # Asked with nothing queued: the latest response that played is named (GA's
        # ``cleared`` requires a ``response_id``; before any, nothing is said).
        held = list(self.queued) or ([self.last] if asked and self.last is not None else [])
        out += [JsonOut({"type": "output_audio_buffer.cleared", "response_id": response})
                for response in held]
        self.cut.update(self.queued)
        self.queued.clear()
        return out
