"""The streaming session: parity with the reference streaming path, offline agreement,
input rules, lifecycle and profiling."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_voicechat_plugin.models.perception.perception_stream import push_frames
from mlx_voicechat_plugin.runtime.events import (
    AssistantTextDelta,
    Audio,
    Cancelled,
    Done,
    FunctionDelta,
    UserTranscriptDelta,
)
from mlx_voicechat_plugin.runtime.streaming import ContextLimit, StreamClosed
from mlx_voicechat_plugin.testing.fixtures import question_signal

PROMPT = "You are a helpful assistant."


@pytest.fixture(scope="module")
def pair(tiny_ckpt):
    from mlx_vlm.utils import load as reference_load

    from mlx_voicechat_plugin import load

    (model, processor), (ref, ref_processor) = load(tiny_ckpt), reference_load(str(tiny_ckpt))
    return model.create_session(processor), ref.create_session(ref_processor)


def _signal(seconds: float) -> np.ndarray:
    return np.concatenate([question_signal(seconds), np.zeros(8000, np.float32)])


def _stream(session, audio, chunk, **options):
    stream = session.create_streaming_session(**options)
    events = []
    for start in range(0, len(audio), chunk):
        events += stream.push_audio(audio[start : start + chunk])
    return stream, events + stream.flush()


def _ref_stream(ref_session, audio, chunk, **options):
    stream = ref_session.create_streaming_session(**options)
    events = []
    for start in range(0, len(audio), chunk):
        events += stream.push_audio(mx.array(audio[start : start + chunk]))
    return stream, events + stream.flush()


def _ours(events):
    codes = [e.audio_codes for e in events if isinstance(e, Audio) and e.audio_codes.size]
    text = [e.token_id for e in events if isinstance(e, AssistantTextDelta)]
    function = [e.token_id for e in events if isinstance(e, FunctionDelta)]
    return np.stack(codes), text, function


def _theirs(events):
    codes = [np.array(e.audio_codes) for e in events if e.kind == "audio"]
    text = [e.token_id for e in events if e.kind == "assistant_text_delta"]
    function = [e.token_id for e in events if e.kind == "function_delta"]
    return np.stack(codes).astype(np.int32), text, function


@pytest.mark.parametrize("chunk", [320, 1000, 1280, 4000])
@pytest.mark.parametrize("prompt", [None, PROMPT], ids=["noprompt", "prompt"])
def test_ids_and_codes_equal_reference_streaming(pair, chunk, prompt):
    ours, ref = pair
    audio = _signal(1.5)
    stream, events = _stream(ours, audio, chunk, system_prompt=prompt, seed=1)
    ref_stream, ref_events = _ref_stream(ref, audio, chunk, system_prompt=prompt, seed=1)
    codes, text, function = _ours(events)
    ref_codes, ref_text, ref_function = _theirs(ref_events)
    assert np.array_equal(codes, ref_codes)
    assert text == ref_text and function == ref_function
    assert stream.text == ref_stream._text.text
    assert stream.transcript == ref_stream._rnnt.text


@pytest.mark.parametrize("prompt", [None, PROMPT], ids=["noprompt", "prompt"])
def test_one_sample_chunks_equal_reference(pair, prompt):
    ours, ref = pair
    audio = _signal(0.2)
    codes, text, _ = _ours(_stream(ours, audio, 1, seed=0, system_prompt=prompt)[1])
    # The reference's output does not depend on its chunking; 1280 keeps it fast.
    ref_codes, ref_text, _ = _theirs(_ref_stream(ref, audio, 1280, seed=0, system_prompt=prompt)[1])
    assert np.array_equal(codes, ref_codes) and text == ref_text


def test_streaming_encoder_within_1e5_of_reference(pair):
    ours, ref = pair
    audio = _signal(1.0)
    stream = ours.create_streaming_session()
    ref_stream = ref.create_streaming_session()
    frame = ours.config.frame_samples
    for start in range(0, len(audio) - frame + 1, frame):
        chunk = audio[start : start + frame]
        _, encoded = push_frames([stream.conversation.compute.perception], [chunk])
        mx.eval(encoded, *stream.conversation.compute.perception.state)
        _, ref_encoded = ref_stream._perception_step(mx.array(chunk))
        assert float(mx.max(mx.abs(encoded - ref_encoded))) <= 1e-5


def test_streaming_agrees_with_offline_on_common_frames(pair):
    ours, _ = pair
    audio = _signal(1.5)
    _, events = _stream(ours, audio, 1280, seed=2, system_prompt=PROMPT)
    codes, _, _ = _ours(events)
    offline = ours.generate(audio, extra_decoding_seconds=0.0, seed=2, system_prompt=PROMPT)
    # Offline's centred mel has one more frame at the end of the input: the
    # streaming frontend only emits frames whose 1280-sample lookahead exists.
    assert len(offline.audio_codes) == len(codes) + 1
    assert np.array_equal(offline.audio_codes[: len(codes)], codes)
    streamed_text = [int(t) for t in offline.text_tokens[: len(codes)]
                     if int(t) not in ours.config.special_text_ids]
    assert streamed_text == [e.token_id for e in events if isinstance(e, AssistantTextDelta)]


def test_streamed_audio_equals_offline_decode_of_the_same_codes(pair):
    ours, _ = pair
    _, events = _stream(ours, _signal(1.0), 1000)
    codes, _, _ = _ours(events)
    samples = np.concatenate([e.samples for e in events if isinstance(e, Audio)])
    decoded = ours.model.tts_model.audio_codec.decode(mx.array(codes.T[None]))
    assert np.array_equal(samples, np.array(decoded[0, 0]))


@pytest.mark.parametrize("option", ["use_language_cache", "use_perception_cache"])
def test_cache_switches_give_same_ids_and_codes(pair, option):
    ours, _ = pair
    audio = _signal(1.0)
    cached = _ours(_stream(ours, audio, 1280, seed=4)[1])
    uncached = _ours(_stream(ours, audio, 1280, seed=4, **{option: False})[1])
    assert np.array_equal(cached[0], uncached[0]) and cached[1:] == uncached[1:]


def test_system_prompt_prefix_emits_nothing(pair):
    ours, _ = pair
    stream = ours.create_streaming_session(system_prompt=PROMPT)
    assert stream.frame_index == 0 and stream.conversation.compute.timeline.positions[0] > 0
    events = stream.push_audio(np.zeros(1280, np.float32))
    assert {e.frame_index for e in events} == {0}


def test_events_end_with_done_and_cumulative_transcript(pair):
    ours, _ = pair
    _, events = _stream(ours, _signal(1.0), 1280)
    assert isinstance(events[-1], Done)
    transcript = [e for e in events if isinstance(e, UserTranscriptDelta)]
    assert transcript and transcript[-1].text.endswith(transcript[-1].delta)


@pytest.mark.parametrize(
    "samples,rate,error,match",
    [
        (np.zeros(100, np.float32), 22050, ValueError, "16000 Hz"),
        (np.array([0.0, np.nan], np.float32), None, ValueError, "non-finite"),
        (np.zeros(100, np.int16), None, TypeError, "float samples"),
        (np.zeros((2, 100), np.float32), None, ValueError, "mono"),
        ([0.0, 0.1], None, TypeError, "numpy or mlx array"),
    ],
    ids=["rate", "nan", "dtype", "stereo", "list"],
)
def test_bad_chunks_are_rejected_and_session_stays_usable(pair, samples, rate, error, match):
    ours, _ = pair
    stream = ours.create_streaming_session()
    stream.push_audio(np.zeros(600, np.float32))
    with pytest.raises(error, match=match):
        stream.push_audio(samples, sample_rate=rate)
    stream.push_audio(np.zeros(680, np.float32))
    assert stream.frame_index == 1  # the 600 pending samples were kept


def test_closed_session_rejects_audio(pair):
    ours, _ = pair
    stream = ours.create_streaming_session()
    stream.flush()
    with pytest.raises(StreamClosed):
        stream.push_audio(np.zeros(10, np.float32))


def test_flush_pads_the_partial_frame_or_drops_it(pair):
    ours, _ = pair
    padded = ours.create_streaming_session()
    padded.push_audio(np.zeros(2000, np.float32))
    assert padded.flush(pad_partial=True)[-1] == Done(2)
    dropped = ours.create_streaming_session()
    dropped.push_audio(np.zeros(2000, np.float32))
    assert dropped.flush(pad_partial=False)[-1] == Done(1)


def test_cancel_drops_pending_audio(pair):
    ours, _ = pair
    stream = ours.create_streaming_session()
    stream.push_audio(np.zeros(2000, np.float32))
    events = stream.cancel()
    # The one frame run still gets its (completed) audio, then Cancelled.
    assert [type(e) for e in events] == [Audio, Cancelled] and events[-1] == Cancelled(1)
    assert events[0].frame_index == 0 and events[0].samples.shape == (1764,)
    assert stream.cancel() == []


def test_max_streaming_seconds_raises_context_limit(pair):
    ours, _ = pair
    stream = ours.create_streaming_session(max_streaming_seconds=0.16)
    stream.push_audio(np.zeros(2560, np.float32))
    with pytest.raises(ContextLimit, match="max_streaming_seconds"):
        stream.push_audio(np.zeros(1280, np.float32))


def test_back_to_back_sessions_do_not_interact(pair):
    ours, _ = pair
    audio = _signal(0.5)
    alone = _ours(_stream(ours, audio, 1280, seed=7)[1])
    a = ours.create_streaming_session(seed=7)
    b = ours.create_streaming_session(seed=8)
    events = []
    for start in range(0, len(audio), 1280):
        events += a.push_audio(audio[start : start + 1280])
        b.push_audio(audio[start : start + 1280])
    interleaved = _ours(events + a.flush())
    assert np.array_equal(alone[0], interleaved[0]) and alone[1:] == interleaved[1:]


def test_profile_summary_and_frame_dump(pair, monkeypatch, tmp_path):
    ours, _ = pair
    dump = tmp_path / "frames.json"
    monkeypatch.setenv("MLX_VOICECHAT_PROFILE_STAGES", "1")
    monkeypatch.setenv("MLX_VOICECHAT_PROFILE_FRAMES", str(dump))
    stream, _ = _stream(ours, _signal(0.5), 1280, profile=True)
    summary = stream.profile().summary(drop_first=2)
    assert summary["frames"] == len(stream.profile().frames) - 2
    assert set(summary["stages"]) == {"perception", "rnnt", "language", "tts", "codec", "total"}
    assert summary["realtime_factor"] == pytest.approx(summary["stages"]["total"]["mean_ms"] / 80.0)
    assert summary["host_syncs"] >= 2 and summary["wait_ms"] >= 0 and summary["async_eval_ms"] >= 0
    assert {"perception.layers", "tts.backbone", "tts.mog_head", "codec.decoder_istft"} <= set(summary["sub_stages"])
    frames = json.loads(dump.read_text())
    assert len(frames) == len(stream.profile().frames) and "stages_ms" in frames[0]
