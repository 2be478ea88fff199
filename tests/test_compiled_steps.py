"""The fast per-frame paths compute exactly what the plain paths compute.

Every compiled or restructured step is checked bit for bit (max-abs 0, equal
ids) against the uncompiled modules it stands in for, on the small fixture
(the real Nemotron-H layer mix) over enough frames to fill every window.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_audio.stt.models.nemotron_asr import StreamingLogMelSpectrogram
from backbone_support import backbone_steps
from mlx_audio.stt.models.nemotron_asr.rnnt import GreedyDecoderState

from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.models.speech.rvq import CodebookTables, rvq_assign, rvq_block
from mlx_voicechat_plugin.models.perception.perception_stream import MelStream, PerceptionStream, push_frames
from mlx_voicechat_plugin.models.rnnt.rnnt import GreedyRNNT, RNNTFrame, RNNTState
from mlx_voicechat_plugin.runtime.rng import RandomStream
from mlx_voicechat_plugin.runtime.timeline import Timeline
from mlx_voicechat_plugin.runtime.warm_start import WarmStart
from mlx_voicechat_plugin.testing.fixtures import question_signal


@pytest.fixture(scope="module")
def small(small_ckpt):
    model, processor = load(small_ckpt)
    model.create_session(processor)  # spells the vocabulary for the TTS
    return model, processor


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b))


def test_llm_step_equals_the_plain_cached_step(small):
    stt = small[0].stt_model
    hidden = small[0].config.text_config.hidden_size
    plain, fast = stt.make_cache(), stt.make_state()
    for t in range(6):
        x = mx.random.normal((1, 1, hidden), key=mx.random.key(t))
        expected = stt(x, cache=plain)
        got = stt.step(x, [fast])
        assert all(_equal(a, b) for a, b in zip(got, expected))


def test_tts_backbone_step_equals_the_plain_backbone(small):
    model = small[0]
    for _, expected, got in backbone_steps(model, WarmStart.of(model)):
        assert _equal(got, expected)


def test_subword_memo_returns_the_direct_embedding_and_stays_out_of_module_state(small):
    encoder = small[0].tts_model.tts_model.embed_subword
    direct = encoder(mx.array([[11]], dtype=mx.int32))
    assert _equal(encoder.token(11), direct)
    assert encoder.token(11) is encoder.token(11)
    assert not any("memo" in key for key in encoder.state)


def test_depth_loop_with_codebook_tables_equals_the_eager_loop(small):
    tts = small[0].tts_model.tts_model
    for seed in range(8):
        hidden = mx.random.normal((2, 1, tts.config.hidden_size), key=mx.random.key(seed))
        stream = RandomStream(seed)
        eager = tts._depth_loop(hidden, SimpleNamespace(next=stream.next))
        assert _equal(tts.generate_codes(hidden, [RandomStream(seed)]), eager)


def test_depth_loop_traces_once_as_new_tokens_arrive(small):
    model = small[0]
    tts = model.tts_model.tts_model
    traces = []
    original = tts._compiled_loop
    tts._compiled_depth = None
    tts._compiled_loop = lambda *a: traces.append(1) or original(*a)
    try:
        timeline = Timeline(model, WarmStart.of(model))
        for token in (5, 6, 7, 8):
            tts.backbone_step(timeline.prev_codes, mx.array([[token]]), timeline.tts_caches)
            mx.eval(tts.generate_codes(mx.zeros((2, 1, tts.config.hidden_size)), timeline.rngs))
    finally:
        del tts._compiled_loop
        tts._compiled_depth = None
    assert len(traces) == 1


def test_rvq_block_is_the_assigned_indices_side_by_side():
    """The depth loop's block (held transposed tables, indices joined at once) is
    ``rvq_assign``'s indices stacked (also with one-product distances, where probed equal)."""
    codebooks = mx.random.normal((4, 32, 8), key=mx.random.key(3))
    residual = mx.random.normal((6, 8), key=mx.random.key(4))
    tables = CodebookTables(codebooks)
    expected = mx.stack(rvq_assign(residual, codebooks), axis=-1)
    for one_product in {False, tables.one_product}:
        got = rvq_block(residual, tables.tables, tables.norms, tables.transposed, one_product)
        assert got.shape == (6, 4) and _equal(got, expected)


def test_rvq_assign_with_precomputed_norms_equals_computed_norms():
    codebooks = mx.random.normal((3, 32, 4), key=mx.random.key(1))
    residual = mx.random.normal((5, 4), key=mx.random.key(2))
    norms = (codebooks * codebooks).sum(axis=-1)
    tables = [codebooks[k] for k in range(3)]
    expected = rvq_assign(residual, codebooks)
    got = rvq_assign(residual, tables, [norms[k] for k in range(3)])
    assert all(_equal(a, b) for a, b in zip(got, expected))


def test_random_stream_take_equals_successive_next():
    a, b = RandomStream(4), RandomStream(4)
    assert _equal(a.take(6), mx.stack([b.next() for _ in range(6)]))
    assert _equal(a.next(), b.next())


def test_mel_stream_equals_mlx_audio_streaming_frontend(small):
    args = small[0].config.audio_config.preprocessor
    frame = small[0].config.frame_samples
    ours, theirs = MelStream(args, frame), StreamingLogMelSpectrogram(args, lookahead_samples=frame)
    audio = question_signal(1.0)
    for start in range(0, len(audio), 700):  # chunks that straddle frames
        chunk = audio[start : start + 700]
        assert _equal(ours.push(chunk), theirs.push(mx.array(chunk)))


def _two_perception_streams(small):
    """Two fresh streaming perceptions (each with its own encoder stream) and audio that
    fills the window and goes 12 frames on."""
    model = small[0]
    frame = model.config.frame_samples
    left = model.stt_model.perception.att_context[0]
    audio = np.resize(question_signal(4.0), (left + 12) * frame)
    first, second = (PerceptionStream(model.stt_model.perception, model.config) for _ in range(2))
    return first, second, audio, frame


def _step(stream, chunk):
    """One frame of one stream, evaluated with its carried state."""
    projected, encoded = push_frames([stream], [chunk])
    mx.eval(projected, encoded, *stream.state)
    return projected, encoded


def test_encoder_stream_compiled_frames_equal_the_plain_blocks(small):
    fast, plain, audio, frame = _two_perception_streams(small)
    enc, cache = plain.encoder, plain.cache
    enc._run_subsampling = enc._subsampling  # uncompiled
    steady = 0
    for start in range(0, len(audio), frame):
        chunk = audio[start : start + frame]
        steady += fast.encoder._is_steady(fast.cache, mx.zeros((1, 1, 1)))
        got = _step(fast, chunk)[1]
        mel = plain.mel.push(chunk)
        x = enc.subsample(cache, mel)
        for index in range(len(enc.encoder.layers)):
            cached = cache.attention[index]
            length = x.shape[1] + (0 if cached is None else cached.shape[1])
            x, cache.attention[index], cache.conv[index] = enc._block(
                index, x, cached, cache.conv[index], enc._pos(index, length, x.dtype)
            )
        mx.eval(x, *cache.state)
        assert _equal(got, x)
    assert steady >= 10


def test_cached_key_value_rows_equal_projecting_the_whole_window(small):
    """Encoder K/V cached per row is bit-identical to the reference's whole-window
    projection on this backend (``cache_kv=False`` keeps the reference's path)."""
    cached, whole, audio, frame = _two_perception_streams(small)
    assert cached.encoder.cache_kv
    whole.encoder.cache_kv = False
    for start in range(0, len(audio), frame):
        chunk = audio[start : start + frame]
        assert _equal(_step(cached, chunk)[1], _step(whole, chunk)[1])


def test_rnnt_first_try_then_rest_equals_the_whole_frame(small):
    """The streaming split (first try in the first evaluation, the other tries
    only after an emission) gives the same symbols and carry as one frame."""
    model = small[0]
    stt, config = model.stt_model, model.config
    vocabulary = list(config.rnnt_vocabulary)
    encoded = mx.random.normal((1, 30, config.audio_config.encoder.d_model), key=mx.random.key(7))
    for max_symbols in (1, 2, config.audio_config.max_symbols):
        greedy = GreedyRNNT(stt.rnnt_decoder, stt.rnnt_joint, config.rnnt_blank_id, max_symbols)
        whole, split = RNNTState(greedy, vocabulary), RNNTState(greedy, vocabulary)
        for t in range(encoded.shape[1]):
            frame = encoded[:, t : t + 1]
            expected = whole.advance(frame)
            tries = RNNTFrame(greedy, split.begin(frame.dtype), frame)
            mx.eval(expected, *tries.arrays, *whole.state)
            rest = tries.rest()
            mx.eval(*rest)
            got = tries.symbols()[0]
            assert whole.commit(expected) == split.commit(got)
            assert all(_equal(a, b) for a, b in zip(whole.state, split.state))
            if got[0] == config.rnnt_blank_id:
                assert not rest and len(got) == 1  # a blank first try skips the rest
        assert whole.text == split.text


def test_branchless_rnnt_equals_mlx_audio_greedy_decoder(small):
    """Same symbols as mlx-audio's eager NeMo greedy loop, frame for frame."""
    model = small[0]
    stt, config = model.stt_model, model.config
    vocabulary = list(config.rnnt_vocabulary)
    encoded = mx.random.normal((1, 40, config.audio_config.encoder.d_model), key=mx.random.key(5))
    for max_symbols in (1, 2, config.audio_config.max_symbols):
        greedy = GreedyRNNT(stt.rnnt_decoder, stt.rnnt_joint, config.rnnt_blank_id, max_symbols)
        state = RNNTState(greedy, vocabulary)
        for t in range(encoded.shape[1]):  # all tries of each frame, as a file is decoded
            symbols = state.advance(encoded[:, t : t + 1])
            mx.eval(symbols, *state.state)
            state.commit(symbols)
        eager = GreedyDecoderState(SimpleNamespace(
            decoder=stt.rnnt_decoder, joint=stt.rnnt_joint, blank_id=config.rnnt_blank_id,
            max_symbols=max_symbols, vocabulary=vocabulary,
            encoder_config=SimpleNamespace(subsampling_factor=8),
            preprocessor_config=SimpleNamespace(hop_length=160, sample_rate=16000),
        ))
        assert state.tokens == [t.id for t in eager.decode(encoded, 0)]
        assert state.tokens  # the fixture emits


def test_rnnt_tries_gather_each_symbols_first_layer_input_from_a_table(small):
    """A try reads the first LSTM layer's input part of its symbol from a table made at
    load (one gather, no embedding product), whose rows are that product's bits."""
    from mlx_voicechat_plugin.models.rnnt.prediction_step import input_part

    model = small[0]
    stt, config = model.stt_model, model.config
    greedy = GreedyRNNT(stt.rnnt_decoder, stt.rnnt_joint, config.rnnt_blank_id, 2)
    table = greedy._inputs
    assert table is not None
    embed, lstm = stt.rnnt_decoder.prediction["embed"], stt.rnnt_decoder.prediction["dec_rnn"].lstm
    wx32 = None if greedy._held is None else greedy._held[0][0]
    for symbol in (0, 1, config.rnnt_blank_id - 1, table.shape[0] - 1):
        part = input_part(lstm[0], embed(mx.array([symbol])), wx32)
        part = mx.concatenate(part, axis=-1) if isinstance(part, list) else part
        assert _equal(table[symbol : symbol + 1], part)


def test_rnnt_carries_merge_extract_and_set_state_row_for_row(small):
    """A carry of two streams run as one batch gives back each stream's own carry and
    symbols (``merge`` / ``extract``), and ``state`` set on a new carry restores it."""
    from mlx_voicechat_plugin.models.rnnt.rnnt import RNNTCarry

    model = small[0]
    stt, config = model.stt_model, model.config
    greedy = GreedyRNNT(stt.rnnt_decoder, stt.rnnt_joint, config.rnnt_blank_id,
                        config.audio_config.max_symbols)
    d_model = config.audio_config.encoder.d_model
    alone = [greedy.initial(mx.float32) for _ in range(2)]
    batch = RNNTCarry.merge([greedy.initial(mx.float32) for _ in range(2)])
    for t in range(6):
        encoded = mx.random.normal((2, 1, d_model), key=mx.random.key(t))
        expected = [greedy(encoded[b : b + 1], alone[b], greedy.max_symbols) for b in range(2)]
        got = greedy(encoded, batch, greedy.max_symbols)
        for b in range(2):
            assert _equal(got[b : b + 1], expected[b])
            assert all(_equal(x, y) for x, y in zip(batch.extract(b).state, alone[b].state))
    restored = RNNTCarry([])
    restored.state = batch.state
    assert restored.batch_size == 2
    assert all(_equal(x, y) for x, y in zip(restored.state, batch.state))
