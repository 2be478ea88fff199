"""Every precision profile runs end to end: offline, streaming, the session pool, the
server; parity with the reference wherever the reference runs that checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from server_support import FRAME, LiveServer, as_received, running
from test_server_parity import in_process, over_websocket

from conformance.diff import run_pair
from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.profiles import PROFILES
from mlx_voicechat_plugin.runtime.events import AssistantTextDelta, Audio, FunctionDelta
from mlx_voicechat_plugin.runtime.options import ConversationOptions
from mlx_voicechat_plugin.runtime.pool import StreamPool
from mlx_voicechat_plugin.server.app import create_app
from mlx_voicechat_plugin.testing.fixtures import cached_checkpoint, question_signal

# Profiles whose checkpoints the reference (mlx_vlm) runs: it loads every profile,
# but its MoG head reads ``proj_mus.weight`` as a matrix, so a quantized MoG head
# (lean, q8) fails at its first spoken frame.
REFERENCE_RUNS = ("release", "bf16")


def _signal(seconds: float, seed: int = 0) -> np.ndarray:
    return np.concatenate([question_signal(seconds, seed=seed), np.zeros(8000, np.float32)])


@pytest.fixture(scope="module", params=list(PROFILES))
def profiled(request):
    path = cached_checkpoint("tiny", profile=request.param)
    model, processor = load(path)
    return request.param, path, model.create_session(processor)


def _stream(voicechat, audio, chunk=FRAME, **options):
    stream = voicechat.create_streaming_session(**options)
    events = []
    for start in range(0, len(audio), chunk):
        events += stream.push_audio(audio[start : start + chunk])
    return events + stream.flush()


def _outputs(events) -> dict:
    return {
        "text": [e.token_id for e in events if isinstance(e, AssistantTextDelta)],
        "function": [e.token_id for e in events if isinstance(e, FunctionDelta)],
        "codes": [e.audio_codes.tolist() for e in events if isinstance(e, Audio)],
        "samples": b"".join(e.samples.tobytes() for e in events if isinstance(e, Audio)),
    }


def _streamed_and_offline(voicechat, seconds: float, seed: int):
    """A question streamed in 1280-sample chunks, and offline: (events, codes, offline)."""
    audio = _signal(seconds)
    events = _stream(voicechat, audio, 1280, seed=seed)
    codes = np.stack([e.audio_codes for e in events if isinstance(e, Audio)
                      and e.audio_codes.size])
    return events, codes, voicechat.generate(audio, extra_decoding_seconds=0.0, seed=seed)


def test_streaming_equals_offline(profiled):
    _, _, voicechat = profiled
    events, codes, offline = _streamed_and_offline(voicechat, 1.5, seed=2)
    assert len(offline.audio_codes) == len(codes) + 1  # offline's centred last mel frame
    assert np.array_equal(offline.audio_codes[: len(codes)], codes)
    special = voicechat.config.special_text_ids
    assert [int(t) for t in offline.text_tokens[: len(codes)] if int(t) not in special] == [
        e.token_id for e in events if isinstance(e, AssistantTextDelta)]


def test_the_pools_batched_rows_equal_each_session_alone(profiled):
    _, _, voicechat = profiled
    sessions = {"a": (0, _signal(1.2, 1), dict(seed=1)),
                "b": (3, _signal(0.8, 2), dict(seed=2, system_prompt="Be brief."))}
    pool = StreamPool(voicechat, max_sessions=len(sessions))
    events: dict[str, list] = {k: [] for k in sessions}
    cursor = dict.fromkeys(sessions, 0)
    step = 0
    while any(cursor[k] < len(audio) for k, (_, audio, _) in sessions.items()) or len(pool):
        frames = {}
        for k, (first, audio, options) in sessions.items():
            if step == first:
                pool.open(k, ConversationOptions(**options))
            if k in pool and cursor[k] + FRAME <= len(audio):
                frames[k] = audio[cursor[k] : cursor[k] + FRAME]
                cursor[k] += FRAME
            elif k in pool:
                events[k] += pool.flush(k, partial=audio[cursor[k]:])
                cursor[k] = len(audio)
                pool.close(k)
        result = pool.step(frames)
        assert not result.errors
        for k, chunk in result.events.items():
            events[k] += chunk
        step += 1
    for k, (_, audio, options) in sessions.items():
        assert _outputs(events[k]) == _outputs(_stream(voicechat, audio, **options)), k


@pytest.mark.parametrize("path_kind", ["offline", "streaming"])
def test_reference_parity_where_the_reference_runs_it(profiled, question_audio, path_kind):
    from conformance.stream_diff import run_stream_pair

    profile, path, _ = profiled
    if profile not in REFERENCE_RUNS:
        pytest.skip(f"the reference cannot run {profile} (its quantized MoG head)")
    diff = run_pair if path_kind == "offline" else run_stream_pair
    diffs = diff(path, question_audio, seed=1, extra_decoding_seconds=1.0)
    assert all(d.ok for d in diffs), "\n".join(d.row() for d in diffs)


def test_every_projection_block_fuses(profiled):
    """Fused q/k/v, gate/up and MoG heads take quantized layers as they take plain ones."""
    model = profiled[2].model
    assert model.fused_blocks == len(model._projection_blocks()) > 0


@pytest.mark.parametrize("profile", [p for p in PROFILES if p not in REFERENCE_RUNS])
def test_the_reference_loads_but_cannot_speak_with_a_quantized_mog_head(profile):
    import mlx.core as mx
    from mlx_vlm.utils import load as reference_load

    ref, processor = reference_load(str(cached_checkpoint("tiny", profile=profile)))
    assert "QuantizedLinear" in type(ref.tts_model.tts_model.mog_head.proj_mus).__name__
    with pytest.raises(ValueError, match="matmul"):
        ref.create_session(processor).generate(mx.array(_signal(0.5)),
                                               extra_decoding_seconds=0.0)


def test_the_server_streams_what_the_session_streams(profiled):
    profile, path, _ = profiled
    if profile == "release":
        pytest.skip("the release layout is tests/test_server_parity.py's")
    audio = as_received(_signal(1.0))
    for live in running(LiveServer(create_app(path))):
        expected, got = in_process(path, audio), over_websocket(live, audio)
    for key in ("transcript", "text", "function", "text_deltas", "codes"):
        assert got[key] == expected[key], key
    np.testing.assert_array_equal(got["pcm"], expected["pcm"])


def test_mlx_vlm_s_every_layer_quantized_output_runs(tmp_path):
    """``python -m mlx_vlm.convert -q`` quantizes every linear layer and embedding whose
    width group 64 divides (EAR-TTS, its character encoder and fusion too): the plugin
    runs it, streaming as offline."""
    import mlx.nn as nn
    from mlx_vlm.convert import convert

    out = tmp_path / "q4-all"
    convert(str(cached_checkpoint("tiny")), str(out), quantize=True, q_bits=4, q_group_size=64)
    model, processor = load(out)
    quantized = {p for p, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    from mlx_voicechat_plugin.profiles import part_of

    assert {part_of(p).name for p in quantized} >= {"llm", "tts_backbone", "mog_head",
                                                     "tts_inputs"}
    _, codes, offline = _streamed_and_offline(model.create_session(processor), 1.0, seed=2)
    assert np.array_equal(offline.audio_codes[: len(codes)], codes)


@pytest.mark.parametrize("profile", ["lean", "balanced"])
def test_the_small_fixture_streams_as_offline(profile):
    """The small fixture's widths take group 64 where the tiny one's fall back to 32."""
    model, processor = load(cached_checkpoint("small", profile=profile))
    _, codes, offline = _streamed_and_offline(model.create_session(processor), 1.5, seed=4)
    assert np.array_equal(offline.audio_codes[: len(codes)], codes)
