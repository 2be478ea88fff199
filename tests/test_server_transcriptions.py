"""``POST /v1/audio/transcriptions``: each parameter rule, the formats, SSE, limits, equality."""

from __future__ import annotations

import io
import json
import threading
import wave

import httpx
import numpy as np
import pytest
from httpx_sse import connect_sse
from server_support import LiveServer, running

from mlx_voicechat_plugin.runtime.transcribe import Transcription
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.server.engine import Engine, load_voicechat
from mlx_voicechat_plugin.server.limits import ServerLimits
from mlx_voicechat_plugin.testing.fixtures import question_signal

API_KEY = "sk-transcribe-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PATH = "/v1/audio/transcriptions"
TIMEOUT = 120.0


def wav_bytes(samples: np.ndarray, rate: int = 16_000, channels: int = 1) -> bytes:
    pcm = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2")
    if channels > 1:
        pcm = np.repeat(pcm[:, None], channels, axis=1).reshape(-1)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()


QUESTION = question_signal(2.0)
QUESTION_WAV = wav_bytes(QUESTION)


@pytest.fixture(scope="module")
def voicechat(tiny_ckpt):
    return load_voicechat(str(tiny_ckpt))


@pytest.fixture(scope="module")
def server(tiny_ckpt, voicechat):
    limits = ServerLimits(max_upload_bytes=400_000, max_transcription_seconds=5.0)
    engine = Engine(str(tiny_ckpt), loader=lambda _: voicechat)
    app = create_app(tiny_ckpt, alias="served-voicechat", api_key=API_KEY, limits=limits,
                     engine=engine)
    yield from running(LiveServer(app))


@pytest.fixture(scope="module")
def offline_transcript(voicechat):
    """What a full offline ``generate`` with no extra decoding seconds reports for the question
    as the server reads it (a file is transcribed with nothing appended)."""
    from mlx_audio.audio_io import read

    samples, _ = read(io.BytesIO(QUESTION_WAV), dtype="float32", sample_rate=16_000, nchannels=1)
    transcript = voicechat.generate(np.asarray(samples, np.float32),
                                    extra_decoding_seconds=0.0).user_transcript
    assert transcript  # the fixture's RNNT emits tokens
    return transcript


def post(server, files=None, data=None, headers=AUTH, path=PATH, **kwargs) -> httpx.Response:
    if files is None:
        files = {"file": ("q.wav", QUESTION_WAV, "audio/wav")}
    return httpx.post(server.http(path), files=files, data=data or {}, headers=headers,
                      timeout=TIMEOUT, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# --- results --------------------------------------------------------------


def test_json_transcript_equals_the_offline_generate_transcript(server, offline_transcript):
    response = post(server)
    assert response.status_code == 200, response.text
    assert response.json() == {"text": offline_transcript}


def test_verbose_json_adds_duration_and_language(server, offline_transcript):
    body = post(server, data={"response_format": "verbose_json"}).json()
    assert body["text"] == offline_transcript
    assert body["language"] == "en"
    assert body["duration"] == pytest.approx(2.0)
    assert body["task"] == "transcribe"


def test_text_format_is_the_plain_transcript(server, offline_transcript):
    response = post(server, data={"response_format": "text"})
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text == offline_transcript + "\n"


def test_any_rate_and_channel_count_is_read_as_mono_16k(server):
    from mlx_audio.utils import resample_audio

    stereo = wav_bytes(np.asarray(resample_audio(QUESTION, 16_000, 24_000), np.float32),
                       24_000, channels=2)
    response = post(server, files={"file": ("q.wav", stereo, "audio/wav")},
                    data={"response_format": "verbose_json"})
    assert response.status_code == 200, response.text
    assert response.json()["duration"] == pytest.approx(2.0, abs=0.01)


def test_the_served_model_name_and_auto_language_are_accepted(server, offline_transcript):
    for data in ({"model": "served-voicechat"}, {"model": "tiny"}, {"language": "auto"},
                 {"language": "en", "temperature": "0", "prompt": ""}):
        response = post(server, data=data)
        assert response.json() == {"text": offline_transcript}, data


def test_max_new_tokens_limits_the_output_tokens(server, offline_transcript):
    text = post(server, data={"max_new_tokens": "1"}).json()["text"]
    assert text and offline_transcript.startswith(text) and text != offline_transcript


# --- streaming ------------------------------------------------------------


def _sse_events(server, data: dict) -> list[dict]:
    with httpx.Client(timeout=TIMEOUT, headers=AUTH) as client:
        with connect_sse(client, "POST", server.http(PATH), data={"stream": "true", **data},
                         files={"file": ("q.wav", QUESTION_WAV, "audio/wav")}) as source:
            assert source.response.headers["content-type"].startswith("text/event-stream")
            return [json.loads(event.data) for event in source.iter_sse()]


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_stream_sends_deltas_then_one_done_event(server, offline_transcript, fmt):
    events = _sse_events(server, {"response_format": fmt})
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "transcript.text.done" and kinds.count("transcript.text.done") == 1
    assert set(kinds[:-1]) == {"transcript.text.delta"}
    assert events[-1]["text"] == offline_transcript
    assert "".join(e["delta"] for e in events[:-1]).strip() == offline_transcript


def test_stream_with_verbose_json_is_400(server):
    error = error_of(post(server, data={"stream": "true", "response_format": "verbose_json"}), 400)
    assert error["param"] == "stream" and "json or text" in error["message"]


# --- parameter rules (each 400 names its parameter) -----------------------


@pytest.mark.parametrize("data, param, words", [
    ({"model": "gpt-4o-transcribe"}, "model", "not served"),
    ({"language": "fr"}, "language", "'auto' or 'en'"),
    ({"response_format": "srt"}, "response_format", "json, verbose_json, text"),
    ({"temperature": "0.2"}, "temperature", "greedy"),
    ({"temperature": "warm"}, "temperature", "must be 0"),
    ({"prompt": "Names: Ada"}, "prompt", "not supported"),
    ({"max_new_tokens": "0"}, "max_new_tokens", "positive integer"),
    ({"max_new_tokens": "ten"}, "max_new_tokens", "positive integer"),
    ({"stream": "maybe"}, "stream", "true or false"),
])
def test_bad_parameters_are_400_naming_the_parameter(server, data, param, words):
    error = error_of(post(server, data=data), 400)
    assert error["param"] == param
    assert words in error["message"]


def test_a_missing_file_is_400(server):
    error = error_of(post(server, files={"other": ("x.txt", b"hi", "text/plain")}), 400)
    assert error["param"] == "file" and "required" in error["message"]


def test_a_file_that_is_not_audio_is_400(server):
    error = error_of(post(server, files={"file": ("q.wav", b"not audio at all" * 64)}), 400)
    assert error["param"] == "file" and "decoded" in error["message"]


def test_a_body_that_is_not_multipart_is_400(server):
    response = httpx.post(server.http(PATH), json={"file": "q.wav"}, headers=AUTH, timeout=TIMEOUT)
    assert error_of(response, 400)["param"] == "file"


def test_translations_answer_400_transcription_only(server):
    error = error_of(post(server, path="/v1/audio/translations"), 400)
    assert "transcribes only" in error["message"]


def test_the_api_key_is_required(server):
    assert post(server, headers={}).status_code == 401
    assert post(server, headers={"Authorization": "Bearer wrong"}).status_code == 401


# --- limits ---------------------------------------------------------------


def test_an_upload_over_the_size_limit_is_413(server):
    big = wav_bytes(np.zeros(210_000, np.float32))  # 420 kB > 400 kB
    error = error_of(post(server, files={"file": ("big.wav", big, "audio/wav")}), 413)
    assert "400000-byte limit" in error["message"]


def test_a_streamed_body_over_the_limit_is_413_without_a_length(server):
    def chunks():
        yield b"--x\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\n"
        for _ in range(10):
            yield b"\0" * 65536

    response = httpx.post(server.http(PATH), content=chunks(), timeout=TIMEOUT,
                          headers={**AUTH, "Content-Type": "multipart/form-data; boundary=x"})
    assert error_of(response, 413)["param"] == "file"


def test_audio_over_the_duration_limit_is_400(server):
    long = wav_bytes(np.zeros(16_000 * 6, np.float32) + 0.01)  # 6 s > 5 s, 192 kB
    error = error_of(post(server, files={"file": ("long.wav", long, "audio/wav")}), 400)
    assert error["param"] == "file" and "5 s" in error["message"]


class GatedEngine(Engine):
    """An engine whose transcriptions wait for ``gate`` before their first step."""

    def __init__(self, path: str, voicechat, gate: threading.Event):
        super().__init__(path, loader=lambda _: voicechat)
        self.gate = gate

    def transcriber(self):
        inner, gate = super().transcriber(), self.gate

        class Gated:
            def steps(self, audio, **options):
                gate.wait(TIMEOUT)
                return (yield from inner.steps(audio, **options))

        return Gated()


def _wait_for(condition) -> None:
    for _ in range(1000):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("condition never held")


def test_requests_past_the_in_flight_limit_are_429(tiny_ckpt, voicechat):
    gate = threading.Event()
    engine = GatedEngine(str(tiny_ckpt), voicechat, gate)
    live = LiveServer(create_app(tiny_ckpt, engine=engine,
                                 limits=ServerLimits(max_transcriptions_in_flight=1)))
    try:
        first: dict = {}
        thread = threading.Thread(target=lambda: first.update(r=post(live, headers={})))
        thread.start()
        _wait_for(lambda: engine.transcriptions.in_flight == 1)
        second = post(live, headers={})
        error = error_of(second, 429)
        assert "--max-transcriptions-in-flight" in error["message"]
        assert second.headers["retry-after"] == "1"
        metrics = httpx.get(live.http("/metrics"), timeout=TIMEOUT).text
        assert "voicechat_transcriptions_refused_total 1.0" in metrics
        assert "voicechat_transcriptions_in_flight 1.0" in metrics
        gate.set()
        thread.join(TIMEOUT)
        assert first["r"].status_code == 200
        assert engine.transcriptions.in_flight == 0  # freed before the reply left
        assert post(live, headers={}).status_code == 200  # the slot was released
    finally:
        gate.set()
        live.stop()


def test_a_refused_request_frees_its_slot(server):
    for _ in range(6):  # more than the in-flight limit (4)
        assert post(server, data={"language": "fr"}).status_code == 400
    assert post(server).status_code == 200


def test_serve_flags_set_the_transcription_limits():
    from mlx_voicechat_plugin.cli import serve

    args = serve.parse(["-m", "ckpt", "--max-upload-bytes", "1000", "--max-transcription-seconds",
                        "9", "--max-transcriptions-in-flight", "2", "--max-transcript-bytes", "50"],
                       "serve", False)
    limits = args.limits
    assert (limits.max_upload_bytes, limits.max_transcription_seconds,
            limits.max_transcriptions_in_flight, limits.max_transcript_bytes) == (1000, 9.0, 2, 50)


@pytest.mark.parametrize("name", ["max_upload_bytes", "max_transcriptions_in_flight",
                                  "max_transcript_bytes", "max_transcription_seconds"])
def test_transcription_limits_must_be_positive(name):
    with pytest.raises(ValueError, match=name):
        ServerLimits(**{name: 0})


# --- the OpenAI client ----------------------------------------------------


def _openai(server):
    from openai import OpenAI

    return OpenAI(base_url=server.http("/v1"), api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


def test_the_openai_client_transcribes(server, offline_transcript):
    client = _openai(server)
    result = client.audio.transcriptions.create(model="served-voicechat",
                                                file=("q.wav", QUESTION_WAV))
    assert result.text == offline_transcript
    verbose = client.audio.transcriptions.create(model="served-voicechat",
                                                 file=("q.wav", QUESTION_WAV),
                                                 response_format="verbose_json")
    assert (verbose.text, verbose.language) == (offline_transcript, "en")
    assert verbose.duration == pytest.approx(2.0)


def test_the_openai_client_streams(server, offline_transcript):
    client = _openai(server)
    events = list(client.audio.transcriptions.create(model="served-voicechat",
                                                     file=("q.wav", QUESTION_WAV), stream=True))
    assert [e.type for e in events][-1] == "transcript.text.done"
    assert events[-1].text == offline_transcript
    assert "".join(e.delta for e in events[:-1]).strip() == offline_transcript


def test_the_openai_client_sees_a_400_naming_the_parameter(server):
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        _openai(server).audio.transcriptions.create(model="served-voicechat", language="fr",
                                                    file=("q.wav", QUESTION_WAV))
    assert raised.value.param == "language"


def test_a_foreign_browser_origin_is_refused_before_any_work(server):
    response = post(server, headers={**AUTH, "Origin": "http://evil.example"})
    assert error_of(response, 403)["code"] == "origin_not_allowed"
    assert post(server, headers={**AUTH, "Origin": "http://localhost:3000"}).status_code == 200


class SteppedEngine(Engine):
    """An engine whose transcriptions are ``steps`` slow steps (the engine job seam)."""

    def __init__(self, path: str, voicechat, steps: int):
        super().__init__(path, loader=lambda _: voicechat)
        self.steps, self.log = steps, []

    def transcriber(self):
        engine = self

        class Slow:
            def steps(self, audio, **options):
                for index in range(engine.steps):
                    threading.Event().wait(0.01)
                    engine.log.append(index)
                    yield []
                return Transcription("finished", [], 1.0, 0, False)

        return Slow()


def test_engine_commands_run_between_transcription_steps(tiny_ckpt, voicechat):
    import asyncio

    engine = SteppedEngine(str(tiny_ckpt), voicechat, steps=100)
    engine.start()
    engine.loaded.wait(TIMEOUT)

    async def scenario():
        assert engine.transcriptions.try_admit(1)
        job, _ = engine.submit_transcription(np.zeros(16_000, np.float32))
        await asyncio.sleep(0.05)
        await engine.close("nobody")  # any command: answered mid-job
        steps_before_reply = len(engine.log)
        assert not job.done()
        assert (await job).text == "finished"
        return steps_before_reply

    try:
        before = asyncio.run(scenario())
        assert 0 < before < 100
        assert engine.transcriptions.in_flight == 0
    finally:
        engine.stop()


def test_a_cancelled_transcription_stops_at_its_next_step(tiny_ckpt, voicechat):
    import asyncio

    engine = SteppedEngine(str(tiny_ckpt), voicechat, steps=1000)
    engine.start()
    engine.loaded.wait(TIMEOUT)

    async def scenario():
        assert engine.transcriptions.try_admit(1)
        job, cancel = engine.submit_transcription(np.zeros(16_000, np.float32))
        await asyncio.sleep(0.05)
        cancel.set()
        with pytest.raises(RuntimeError, match="cancelled"):
            await job

    try:
        asyncio.run(scenario())
        assert len(engine.log) < 1000
        assert engine.transcriptions.in_flight == 0
    finally:
        engine.stop()


def test_metrics_count_finished_and_refused_transcriptions(server):
    def value(text: str, name: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith(name + " "))

    before = httpx.get(server.http("/metrics"), headers=AUTH).text
    assert post(server).status_code == 200
    after = httpx.get(server.http("/metrics"), headers=AUTH).text
    assert value(after, "voicechat_transcriptions_total") == \
        value(before, "voicechat_transcriptions_total") + 1
    assert value(after, "voicechat_transcribed_audio_seconds_total") == pytest.approx(
        value(before, "voicechat_transcribed_audio_seconds_total") + 2.0)
    assert value(after, "voicechat_transcriptions_in_flight") == 0
