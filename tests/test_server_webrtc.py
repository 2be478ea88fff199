"""A WebRTC call, as OpenAI Realtime GA's browser clients make it, against the same question
over the GA WebSocket.

A real aiortc client peer (:mod:`rtc_support`) signals through the openai SDK's
``client.realtime.calls`` (the multipart form, with a session), opens the ``oai-events``
data channel and speaks the fixtures' question on its microphone track, Opus-encoded,
paced in real time; it reads the GA events on the data channel and hears the model on
the server's track. Every ICE candidate is on 127.0.0.1.

How "the same question" is made honest: Opus is lossy, so the audio the model hears over
WebRTC is not the question's samples, and the tiny random model's text follows every
sample. The server takes a call's audio as an ``input_audio_buffer.append`` (the track's
48 kHz PCM16 resampled once, straight to the model's rate: ``MediaInput``), so the test
keeps the 48 kHz PCM16 chunks the call took (what the model heard after the Opus round
trip, the network and the jitter buffer) and sends exactly those chunks over the GA
WebSocket, with the same session, its appends taken as the call's are (``TrackAudio``:
a WebSocket client cannot send 48 kHz). The transcripts and the assistant's text must
then be equal event for event, exactly; that the chunks are the question is checked by
their level and length, and the model's speech through Opus by its energy and length.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import soxr
from server_support import LiveServer, configure, connect, recv, running, send

pytest.importorskip("aiortc")
from rtc_support import LOOPBACK, Caller, opus_round_trip, question_48k  # noqa: E402

from mlx_voicechat_plugin.server.app import create_app  # noqa: E402
from mlx_voicechat_plugin.server.dialects.ga import dialect as ga_dialect  # noqa: E402
from mlx_voicechat_plugin.server.dialects.ga.audio import (  # noqa: E402
    InputAudio, MediaInput, Resampler)
from mlx_voicechat_plugin.server.limits import ServerLimits  # noqa: E402
from mlx_voicechat_plugin.server.transport.ice import ICEConfig  # noqa: E402

API_KEY = "test-key"
QUESTION_SECONDS, SILENCE_SECONDS = 1.5, 0.5
SESSION = {"type": "realtime", "instructions": "Be brief.", "max_response_seconds": 1.5}
TEXT_EVENTS = ("conversation.item.input_audio_transcription.delta",
               "conversation.item.input_audio_transcription.completed",
               "response.output_audio_transcript.delta", "response.output_audio_transcript.done",
               "response.output_text.delta", "response.function_call_arguments.delta")
QUIET_SECONDS = 1.5
# How long the client's audio must pause before the server runs silence frames for an owed
# response (GA's STREAM_LULL_SECONDS), in both calls: longer than any stall a loaded machine
# puts between two chunks of either call (the track's real-time pacing, the WebSocket's
# backpressure), so the server's silence comes after all of the client's audio in both, as
# it does unloaded, and both timelines hear the same input.
LULL_SECONDS = 3.0


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    # A long idle timeout: a loaded machine may take a while over the WebSocket's backlog.
    limits = ServerLimits(update_timeout=10, idle_timeout=120)
    app = create_app(tiny_ckpt, api_key=API_KEY, limits=limits, ice=ICEConfig(hosts=LOOPBACK))
    yield from running(LiveServer(app))


def texts(events: list[dict]) -> list[tuple[str, str]]:
    """The transcripts and the assistant's text, event by event, in order."""
    return [(e["type"], e.get("delta", e.get("transcript", ""))) for e in events
            if e["type"] in TEXT_EVENTS]


def flow(events: list[dict]) -> list[str]:
    """The event types after the session's, audio deltas and the WebRTC-only playback
    events (``output_audio_buffer.*``, tests/test_server_webrtc_playback.py) apart."""
    return [e["type"] for e in events if not e["type"].startswith("session.")
            and e["type"] != "response.output_audio.delta"
            and not e["type"].startswith("output_audio_buffer.")]


async def webrtc_call(server: LiveServer) -> dict:
    caller = Caller(server.http("/openai/v1"), API_KEY,
                    question_48k(QUESTION_SECONDS, SILENCE_SECONDS))
    try:
        await caller.dial(session=SESSION)
        await caller.until("session.updated")
        caller.microphone.go.set()
        await asyncio.wait_for(caller.microphone.finished.wait(), 20)
        while True:  # every response done, and nothing more for a while
            await caller.quiet(QUIET_SECONDS)
            created, done = responses(caller.events), responses(caller.events, "done")
            if created and created == done:
                break
        await caller.hang_up()
        return {"events": caller.events, "heard": caller.audio(), "location": caller.location}
    finally:
        await caller.close()


def responses(events: list[dict], kind: str = "created") -> int:
    """How many ``response.{kind}`` events there are."""
    return sum(1 for e in events if e["type"] == f"response.{kind}")


def websocket_call(server: LiveServer, chunks: list[bytes], done: int) -> dict:
    """The chunks over the GA WebSocket; events until ``done`` responses are, and quiet."""
    events: list[dict] = []
    with connect(server.ws("/openai/v1/realtime"),
                 additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
        configure(ws, **SESSION)
        for chunk in chunks:
            send(ws, {"type": "input_audio_buffer.append",
                      "audio": base64.b64encode(chunk).decode("ascii")})
        while responses(events, "done") < done:
            events.append(recv(ws, timeout=30))
        try:
            while True:
                events.append(recv(ws, timeout=QUIET_SECONDS))
        except TimeoutError:
            pass
    audio = b"".join(base64.b64decode(e["delta"]) for e in events
                     if e["type"] == "response.output_audio.delta")
    return {"events": events, "audio": np.frombuffer(audio, dtype="<i2")}


TRACK_RATE = 48_000  # the rate of the audio a call's track hands over (Opus's)


class TrackAudio(InputAudio):
    """A WebSocket append of a call's track audio (48 kHz PCM16, base64), taken as the
    call's session takes it: :class:`MediaInput`, resampled once."""

    def __init__(self, fmt, model_rate: int):
        super().__init__(fmt, model_rate)
        self.track, self.resample = MediaInput(model_rate), Resampler(model_rate, model_rate)

    def decode(self, audio) -> np.ndarray:
        return self.track.decode(base64.b64decode(audio), TRACK_RATE)[0]


@pytest.fixture(scope="module")
def calls(server):
    """The call over WebRTC, then its heard audio over the GA WebSocket."""
    import _pytest.monkeypatch

    appended: list[bytes] = []
    decode = MediaInput.decode

    def keep(self, data: bytes, rate: int):
        assert rate == TRACK_RATE
        appended.append(data)
        return decode(self, data, rate)

    patch = _pytest.monkeypatch.MonkeyPatch()
    patch.setattr(ga_dialect, "STREAM_LULL_SECONDS", LULL_SECONDS)
    try:
        patch.setattr(MediaInput, "decode", keep)
        try:
            rtc = asyncio.run(webrtc_call(server))
        finally:
            patch.setattr(MediaInput, "decode", decode)
        server.wait_idle()
        done = responses(rtc["events"], "done")
        patch.setattr(ga_dialect, "InputAudio", TrackAudio)
        ws = websocket_call(server, appended, done)
    finally:
        patch.undo()
    return {"rtc": rtc, "ws": ws, "appended": appended}


def test_the_call_is_answered_with_a_location_naming_it(calls):
    assert calls["rtc"]["location"].startswith("/openai/v1/realtime/calls/rtc_")


def test_the_session_comes_from_the_form_and_events_come_on_the_data_channel(calls):
    events = calls["rtc"]["events"]
    assert [e["type"] for e in events[:2]] == ["session.created", "session.updated"]
    assert events[1]["session"]["instructions"] == "Be brief."
    assert "response.done" in flow(events)


def test_no_audio_deltas_on_the_data_channel(calls):
    assert not [e for e in calls["rtc"]["events"] if e["type"] == "response.output_audio.delta"]
    assert [e for e in calls["ws"]["events"] if e["type"] == "response.output_audio.delta"]


def test_transcripts_and_text_equal_the_websocket_exactly(calls):
    rtc, ws = texts(calls["rtc"]["events"]), texts(calls["ws"]["events"])
    assert any(kind.startswith("conversation.item.input_audio") for kind, _ in rtc)
    assert any(kind.startswith("response.output_audio_transcript") for kind, _ in rtc)
    assert rtc == ws


def test_the_events_follow_the_websocket_in_order(calls):
    assert flow(calls["rtc"]["events"]) == flow(calls["ws"]["events"])


def test_each_response_heard_is_started_and_stopped_on_the_data_channel_only(calls):
    rtc, ws = calls["rtc"]["events"], calls["ws"]["events"]
    spoken = {e["response_id"] for e in ws if e["type"] == "response.output_audio.delta"}
    started, stopped = ([e["response_id"] for e in rtc if e["type"] == kind]
                        for kind in ("output_audio_buffer.started", "output_audio_buffer.stopped"))
    assert started and sorted(started) == sorted(stopped) and len(started) == len(spoken)
    assert not [e for e in ws if e["type"].startswith("output_audio_buffer.")]


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(samples.astype(np.float64) ** 2)))


def test_the_model_heard_the_question_through_opus(calls):
    """At the level Opus itself gives this signal (about 0.7 of it), for its length."""
    heard = np.frombuffer(b"".join(calls["appended"]), dtype="<i2")
    sent = question_48k(QUESTION_SECONDS, SILENCE_SECONDS)
    # the jitter buffer keeps the last few 20 ms frames of a track that stopped
    assert sent.shape[0] - 0.2 * TRACK_RATE <= heard.shape[0] <= sent.shape[0]
    question = int(QUESTION_SECONDS * TRACK_RATE)
    opus = rms(opus_round_trip(sent)[:question]) / rms(sent[:question])
    assert abs(rms(heard[:question]) / rms(sent[:question]) - opus) < 0.05


def test_the_models_speech_comes_on_the_track_at_its_level_and_length(calls):
    """The WebSocket's speech, at 48 kHz through Opus offline, is what the track carried:
    the same energy (within 15 %) over the same span (the tiny model's speech is
    noise-like, which Opus keeps at about half its energy)."""
    heard = calls["rtc"]["heard"].astype(np.float64) / 32768
    spoken = calls["ws"]["audio"]
    assert spoken.shape[0] > 0.5 * 24_000
    at_48k = np.round(np.clip(soxr.resample(spoken / 32768, 24_000, 48_000), -1, 1) * 32767)
    through_opus = opus_round_trip(at_48k.astype(np.int16)).astype(np.float64) / 32768
    energy = np.sum(heard ** 2) / np.sum(through_opus ** 2)
    assert 0.85 < energy < 1.15

    def seconds_spoken(samples: np.ndarray) -> float:
        """20 ms windows that are not silence (the track's gaps between responses are)."""
        windows = samples[: samples.shape[0] // 960 * 960].reshape(-1, 960)
        return np.count_nonzero(np.sqrt(np.mean(windows ** 2, axis=1)) > 1e-3) * 0.02

    # each response's first and last window may straddle a boundary
    assert abs(seconds_spoken(heard) - seconds_spoken(through_opus)) < 0.2


def test_the_call_left_nothing_behind(server, calls):
    calls_ = server.app.state.calls
    assert calls_.open == {} and calls_.tasks == {}
    assert server.app.state.engine.admission.sessions_in_use == 0
