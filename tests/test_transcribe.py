"""Transcription only (perception + RNNT): equal to the full paths' transcripts, and its rules."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_voicechat_plugin.runtime.events import Cancelled, Done, UserTranscriptDelta
from mlx_voicechat_plugin.runtime.streaming import ContextLimit, StreamClosed
from mlx_voicechat_plugin.runtime.transcribe import (
    TranscriptDone,
    Transcriber,
    TranscriptLimit,
    checkpoint_language,
)
from mlx_voicechat_plugin.testing.fixtures import make_question_wav, question_signal


@pytest.fixture(scope="module")
def session(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


@pytest.fixture(scope="module")
def transcriber(session):
    return Transcriber(session)


@pytest.fixture(scope="module")
def wav(tmp_path_factory):
    return make_question_wav(tmp_path_factory.mktemp("wav") / "q.wav", seconds=2.0)


@pytest.fixture(scope="module")
def offline(session, wav):
    """The offline turn with no extra decoding seconds: a file is transcribed with nothing
    appended, so this (not ``generate``'s default 3 s tail) is the equal offline transcript."""
    return session.generate(str(wav), extra_decoding_seconds=0.0)


def _stream_events(stream, audio, chunk):
    events = []
    for start in range(0, len(audio), chunk):
        events += stream.push_audio(audio[start : start + chunk])
    return events + stream.flush()


def test_file_transcript_equals_the_offline_transcript_with_no_extra_decoding(transcriber, wav, offline):
    result = transcriber.transcribe(str(wav))
    assert offline.user_transcript  # the fixture's RNNT emits tokens
    assert result.text == offline.user_transcript
    assert result.duration == pytest.approx(2.0)
    assert not result.truncated


FILE_SECONDS = 3.1  # not a whole number of 80 ms frames: the last one is partial


@pytest.fixture(scope="module")
def reference_transcript(tiny_ckpt):
    """The reference's offline RNNT transcript of the file with no extra decoding seconds."""
    import mlx.core as mx
    from mlx_vlm.utils import load as reference_load

    ref, ref_processor = reference_load(str(tiny_ckpt))
    result = ref.create_session(ref_processor).generate(
        mx.array(question_signal(FILE_SECONDS)), extra_decoding_seconds=0.0)
    assert result.user_transcript  # the fixture's RNNT emits tokens
    return result.user_transcript


def test_file_transcript_equals_the_reference_offline_transcript_with_no_extra_decoding(
        transcriber, reference_transcript):
    assert transcriber.transcribe(question_signal(FILE_SECONDS)).text == reference_transcript


@pytest.mark.parametrize("seconds", [FILE_SECONDS, 2.0])
@pytest.mark.parametrize("chunk", [1280, 3000, 16_000])
def test_file_transcript_equals_the_streaming_path_exactly(transcriber, seconds, chunk):
    """A whole file runs the stream's own frames: the same text and tokens, however the
    stream was fed, the partial last frame zero-padded as ``flush`` pads it."""
    audio = question_signal(seconds)
    stream = transcriber.create_stream()
    events = _stream_events(stream, audio, chunk)
    result = transcriber.transcribe(audio)
    assert result.text == stream.transcript == events[-2].text
    assert result.tokens == stream.core.compute.rnnt.tokens
    assert result.frames == stream.frame_index


def test_a_file_runs_its_own_frames_through_the_streaming_encoder(transcriber, monkeypatch):
    """Counted: no whole-signal perception; one streaming perception frame per 80 ms of
    the file (the partial last one included), each committed to the RNNT."""
    from mlx_voicechat_plugin.models.perception.perception import Perception
    from mlx_voicechat_plugin.models.perception.perception_stream import PerceptionRows
    from mlx_voicechat_plugin.models.rnnt.rnnt import RNNTState

    whole, pushed, committed = [0], [0], [0]
    encode_signal, push, commit = Perception.encode_signal, PerceptionRows.push, RNNTState.commit

    def counting_encode_signal(self, *args, **kwargs):
        whole[0] += 1
        return encode_signal(self, *args, **kwargs)

    def counting_push(self, frames, clock=None):
        pushed[0] += len(frames)
        return push(self, frames, clock)

    def counting_commit(self, symbols):
        committed[0] += 1
        return commit(self, symbols)

    monkeypatch.setattr(Perception, "encode_signal", counting_encode_signal)
    monkeypatch.setattr(PerceptionRows, "push", counting_push)
    monkeypatch.setattr(RNNTState, "commit", counting_commit)
    audio = question_signal(FILE_SECONDS)
    result = transcriber.transcribe(audio)
    frames = -(-audio.shape[0] // transcriber.config.frame_samples)
    assert whole[0] == 0
    assert result.frames == pushed[0] == committed[0] == frames


def test_progress_hears_each_step_up_to_the_files_frames(transcriber):
    heard = []
    result = transcriber.transcribe(question_signal(FILE_SECONDS),
                                    on_progress=lambda done, total: heard.append((done, total)))
    totals = {total for _, total in heard}
    assert totals == {result.frames}
    assert [done for done, _ in heard] == sorted(done for done, _ in heard)
    assert heard[-1][0] == result.frames


def test_the_duration_is_the_files_length(transcriber):
    assert transcriber.transcribe(question_signal(FILE_SECONDS)).duration == pytest.approx(
        FILE_SECONDS)


def test_a_file_ends_with_exactly_one_final_transcript(transcriber):
    """The steps yield deltas only; the one final is the returned :class:`Transcription`."""
    steps = transcriber.steps(question_signal(FILE_SECONDS))
    deltas, finals = [], []
    while True:
        try:
            deltas += next(steps)
        except StopIteration as done:
            finals.append(done.value)
            break
    assert all(isinstance(d, UserTranscriptDelta) for d in deltas)
    assert [f.text for f in finals] == [deltas[-1].text]
    with pytest.raises(StopIteration):
        next(steps)  # nothing after the final


def test_file_transcript_streams_deltas_that_add_up_to_the_text(transcriber, wav, offline):
    steps = transcriber.steps(str(wav))
    deltas = []
    while True:
        try:
            deltas += next(steps)
        except StopIteration as done:
            result = done.value
            break
    assert all(isinstance(d, UserTranscriptDelta) for d in deltas)
    assert "".join(d.delta for d in deltas).strip() == result.text == offline.user_transcript
    assert deltas[-1].text == result.text


def test_arrays_transcribe_like_their_file(transcriber, wav):
    from mlx_voicechat_plugin.runtime.audio import load_waveform

    samples = np.array(load_waveform(str(wav), 16_000))
    assert transcriber.transcribe(samples).text == transcriber.transcribe(str(wav)).text


def test_max_new_tokens_bounds_the_output_tokens(transcriber, wav):
    full = transcriber.transcribe(str(wav))
    assert len(full.tokens) > 2
    cut = transcriber.transcribe(str(wav), max_new_tokens=2)
    assert cut.tokens == full.tokens[:2]
    assert cut.truncated
    assert full.text.startswith(cut.text)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_new_tokens_must_be_a_positive_integer(transcriber, wav, value):
    with pytest.raises(ValueError, match="max_new_tokens"):
        transcriber.transcribe(str(wav), max_new_tokens=value)


def test_the_language_defaults_to_english(session):
    assert checkpoint_language(session.config) == "en"


def test_text_only_stream_transcript_equals_a_full_session(session, transcriber):
    audio = np.concatenate([question_signal(2.0), np.zeros(8000, np.float32)])
    full = session.create_streaming_session()
    _stream_events(full, audio, 3000)
    stream = transcriber.create_stream()
    events = _stream_events(stream, audio, 3000)
    assert full.transcript
    assert stream.transcript == full.transcript
    final = [e for e in events if isinstance(e, TranscriptDone)]
    assert [e.text for e in final] == [full.transcript]
    assert isinstance(events[-1], Done)
    deltas = [e for e in events if isinstance(e, UserTranscriptDelta)]
    assert deltas[-1].text == full.transcript


def test_text_only_stream_emits_only_transcript_events(transcriber):
    stream = transcriber.create_stream()
    events = _stream_events(stream, question_signal(1.0), 1280)
    assert {type(e) for e in events} <= {UserTranscriptDelta, TranscriptDone, Done}


def test_an_empty_stream_ends_with_one_empty_final_transcript(transcriber):
    stream = transcriber.create_stream()
    events = stream.flush()
    assert events == [TranscriptDone(0, ""), Done(0)]


def test_flush_runs_the_partial_frame(transcriber):
    stream = transcriber.create_stream()
    stream.push_audio(question_signal(0.05))  # under one frame
    assert stream.frame_index == 0
    stream.flush()
    assert stream.frame_index == 1


def test_audio_after_the_end_of_input_is_rejected(transcriber):
    stream = transcriber.create_stream()
    stream.flush()
    with pytest.raises(StreamClosed, match="after the end of input"):
        stream.push_audio(np.zeros(1280, np.float32))
    with pytest.raises(StreamClosed):
        stream.flush()


def test_cancel_ends_without_a_final_transcript(transcriber):
    stream = transcriber.create_stream()
    stream.push_audio(question_signal(0.2))
    assert stream.cancel() == [Cancelled(stream.frame_index)]
    assert stream.cancel() == []


def test_bad_chunks_are_rejected_and_the_stream_stays_usable(transcriber):
    stream = transcriber.create_stream()
    with pytest.raises(ValueError, match="16000 Hz"):
        stream.push_audio(np.zeros(1280, np.float32), sample_rate=8000)
    with pytest.raises(TypeError, match="float samples"):
        stream.push_audio(np.zeros(1280, np.int16))
    with pytest.raises(ValueError, match="non-finite"):
        stream.push_audio(np.full(1280, np.nan, np.float32))
    stream.push_audio(np.zeros(1280, np.float32))
    assert stream.frame_index == 1


def test_buffered_pcm_is_bounded(transcriber):
    stream = transcriber.create_stream(max_buffered_samples=4000)
    with pytest.raises(ValueError, match="max_buffered_samples=4000"):
        stream.push_audio(np.zeros(4001, np.float32))
    assert stream.frame_index == 0
    stream.push_audio(np.zeros(4000, np.float32))
    assert stream.frame_index == 3


def test_stream_length_is_bounded(transcriber):
    stream = transcriber.create_stream(max_streaming_seconds=0.16)
    with pytest.raises(ContextLimit, match="max_streaming_seconds=0.16"):
        stream.push_audio(np.zeros(1280 * 3, np.float32))
    assert stream.frame_index == 2
    assert isinstance(stream.flush()[-2], TranscriptDone)


def test_transcript_bytes_are_bounded(transcriber):
    stream = transcriber.create_stream(max_transcript_bytes=1)
    with pytest.raises(TranscriptLimit, match="max_transcript_bytes=1") as raised:
        for start in range(0, 32000, 1280):
            stream.push_audio(question_signal(2.0)[start : start + 1280])
    assert len(stream.transcript.encode()) >= 1
    final = stream.flush()
    assert final[-2] == TranscriptDone(stream.frame_index, stream.transcript)
    assert isinstance(raised.value, ContextLimit)


@pytest.mark.parametrize("name", ["max_transcript_bytes", "max_buffered_samples"])
def test_stream_budgets_must_be_positive_integers(transcriber, name):
    with pytest.raises(ValueError, match=name):
        transcriber.create_stream(**{name: 0})


def test_only_perception_and_the_rnnt_run(transcriber, wav, monkeypatch):
    """No timeline (LLM + TTS), language model, speech decoder or codec work at all."""
    from mlx_voicechat_plugin.models.codec.codec import Codec, CodecDecoder
    from mlx_voicechat_plugin.models.language.duplex import DuplexSTT
    from mlx_voicechat_plugin.runtime import timeline

    def boom(*args, **kwargs):
        raise AssertionError("a transcription ran more than perception and the RNNT")

    monkeypatch.setattr(timeline.Timeline, "__init__", boom)
    monkeypatch.setattr(DuplexSTT, "__call__", boom)
    monkeypatch.setattr(DuplexSTT, "step", boom)
    monkeypatch.setattr(DuplexSTT, "fuse", boom)
    monkeypatch.setattr(CodecDecoder, "__call__", boom)
    for name in ("decode", "decode_step", "make_state"):
        monkeypatch.setattr(Codec, name, boom)
    assert transcriber.transcribe(str(wav)).text
    stream = transcriber.create_stream()
    stream.push_audio(question_signal(1.0))
    stream.flush()
    assert stream.transcript


def test_text_only_streams_share_a_pool_step_with_full_sessions(session, transcriber):
    """In one pool, each kind's transcript equals that stream run alone."""
    from mlx_voicechat_plugin.runtime.options import ConversationOptions, TranscriptionOptions
    from mlx_voicechat_plugin.runtime.pool import StreamPool

    audio = {"full": question_signal(1.2, seed=1), "text": question_signal(1.6, seed=2)}
    alone = transcriber.create_stream()
    _stream_events(alone, audio["text"], 1280)
    solo_full = session.create_streaming_session(seed=1)
    _stream_events(solo_full, audio["full"], 1280)

    pool = StreamPool(session, max_sessions=2)
    pool.open("full", ConversationOptions(seed=1))
    stream = pool.open("text", TranscriptionOptions())
    for start in range(0, 1280 * 20, 1280):
        frames = {k: a[start : start + 1280] for k, a in audio.items() if start < len(a)}
        result = pool.step(frames)
        assert not result.errors
    assert 0 < pool.nbytes("text") < pool.state_bytes  # measured, as full sessions
    finals = {k: pool.flush(k) for k in audio}
    assert pool.get("text").transcript == alone.transcript
    assert pool.get("full").transcript == solo_full.transcript
    assert [e.text for e in finals["text"] if isinstance(e, TranscriptDone)] == [alone.transcript]
    pool.close_all()
    assert pool.state_bytes == 0


def test_a_text_only_stream_joins_the_full_sessions_hearing_batch(session, transcriber,
                                                                   monkeypatch):
    """Stepped with two full sessions, a text-only stream's perception and RNNT rows run in
    the same batches as theirs (counted), and every session's outputs equal its own run alone."""
    from mlx_voicechat_plugin.runtime import hearing
    from mlx_voicechat_plugin.runtime.events import AssistantTextDelta, Audio
    from mlx_voicechat_plugin.runtime.options import ConversationOptions, TranscriptionOptions
    from mlx_voicechat_plugin.runtime.pool import StreamPool

    def outputs(events):
        return ([e.token_id for e in events if isinstance(e, AssistantTextDelta)],
                b"".join(e.samples.tobytes() for e in events if isinstance(e, Audio)))

    audio = {"a": question_signal(1.2, seed=1), "b": question_signal(0.8, seed=3),
             "text": question_signal(1.6, seed=2)}
    seeds = {"a": 1, "b": 2}
    alone = {k: session.create_streaming_session(seed=seed) for k, seed in seeds.items()}
    alone["text"] = transcriber.create_stream()
    solo = {k: _stream_events(alone[k], a, 1280) for k, a in audio.items()}

    perceived, decoded = [], []
    push, tries = hearing.PerceptionRows.push, hearing.RNNTFrame

    def counting_push(rows, frames, clock=None):
        perceived.append(len(rows.streams))
        return push(rows, frames, clock)

    class CountingTries(tries):
        def __init__(self, greedy, carry, encoded):
            decoded.append(encoded.shape[0])
            super().__init__(greedy, carry, encoded)

    monkeypatch.setattr(hearing.PerceptionRows, "push", counting_push)
    monkeypatch.setattr(hearing, "RNNTFrame", CountingTries)
    pool = StreamPool(session, max_sessions=3)
    for k, seed in seeds.items():
        pool.open(k, ConversationOptions(seed=seed))
    pool.open("text", TranscriptionOptions())
    events = {k: [] for k in audio}
    sizes = []
    for start in range(0, max(len(a) for a in audio.values()), 1280):
        frames = {k: a[start : start + 1280] for k, a in audio.items()
                  if start + 1280 <= len(a)}
        if not frames:
            break
        result = pool.step(frames)
        assert not result.errors
        sizes.append(len(frames))
        for k, chunk in result.events.items():
            events[k] += chunk
    for k in audio:
        events[k] += pool.flush(k)
    assert perceived[: len(sizes)] == sizes and decoded[: len(sizes)] == sizes
    assert sizes[0] == 3  # the text-only stream shared its steps' perception and RNNT batches
    assert pool.get("text").transcript == alone["text"].transcript
    assert events["text"] == solo["text"]
    for k in seeds:
        assert pool.get(k).transcript == alone[k].transcript
        assert outputs(events[k]) == outputs(solo[k]), k
    pool.close_all()


def test_a_closed_stream_holds_no_state(transcriber):
    stream = transcriber.create_stream()
    stream.push_audio(question_signal(0.5))
    assert stream.nbytes > 0
    stream.flush()
    assert stream.state == [] and stream.nbytes == 0
