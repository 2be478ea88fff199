"""Batched EAR-TTS frames equal each session's single frames, bit for bit.

Several sessions sit at different positions (some past the backbone's
sliding window), with different seeds. One batched frame over all of them
must give every session exactly the hidden state and codes its own
``backbone_step`` + ``generate_codes`` (a batch of one) would give, and leave its caches and
key stream exactly where the single calls leave them, so that single and
batched frames can follow each other in any order. No tolerance anywhere:
``mx.array_equal``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.models.cache_state import (
    cache_meta_state,
    cache_state,
    caches_from_state,
    copy_arrays,
)
from mlx_voicechat_plugin.models.speech.mog_head import draw
from mlx_voicechat_plugin.models.speech.gemma_step import GemmaStep
from mlx_voicechat_plugin.runtime.rng import RandomStream
from mlx_voicechat_plugin.runtime.warm_start import WarmStart

# Frames each session runs alone before batching: the fixture's sliding window
# is 64 and the warm start ends at 37, so the last two are past the window.
PRIOR_STEPS = (0, 5, 30, 70)
SEEDS = (0, 1, 7, 123456789)
TEXT_IDS = (3, 17, 12, 2, 40, 5, 29, 11, 8)  # includes pad (12) and eos (2)


def _quantizable(path: str, module: nn.Module) -> bool:
    # proj_mus is read as a weight table, not called.
    return isinstance(module, nn.Linear) and module.weight.shape[1] % 32 == 0 and path != "proj_mus"


def _quantize_tts(model) -> None:
    """4-bit linears in the TTS backbone and MoG head (the fixture's own 4-bit
    checkpoint quantizes only the language model)."""
    tts = model.tts_model.tts_model
    for part in (tts.backbone, tts.mog_head):
        nn.quantize(part, group_size=32, bits=4, class_predicate=_quantizable)


def _load(path: Path, quantize_tts: bool = False, hold_f32: bool = True):
    model, processor = load(path, hold_f32=hold_f32)
    model.create_session(processor)  # spells the vocabulary for the TTS
    if quantize_tts:
        _quantize_tts(model)
    return model


@pytest.fixture(scope="module",
                params=["tiny", "tiny-q4", "tiny-tts-q4", "tiny-bf16", "small"])
def model(request, tiny_ckpt, tiny_q4_ckpt, small_ckpt):
    """Float32 (as loaded), the 4-bit checkpoint, a 4-bit TTS, bf16 as stored, small."""
    path = {"tiny": tiny_ckpt, "tiny-q4": tiny_q4_ckpt, "tiny-tts-q4": tiny_ckpt,
            "tiny-bf16": tiny_ckpt, "small": small_ckpt}[request.param]
    _STARTS.clear()  # a model freed before may share its id with this one
    return _load(path, quantize_tts=request.param == "tiny-tts-q4",
                 hold_f32=request.param != "tiny-bf16")


_STARTS: dict[int, WarmStart] = {}  # per loaded model (by id; the models live for the module)


def session_rows(hidden: mx.array, session: int, sessions: int) -> mx.array:
    """Session ``session``'s ``[cond; uncond]`` rows of a batched guided hidden."""
    return hidden[session::sessions]


class Speaker:
    """One session's TTS state: its backbone caches, key stream and last codes."""

    def __init__(self, model, seed: int):
        start = _STARTS.get(id(model)) or _STARTS.setdefault(id(model), WarmStart.of(model))
        self.tts = model.tts_model.tts_model
        self.cache = start.fresh_cache()
        self.rng = RandomStream(seed)
        self.prev = start.prev_codes
        self.frames = 0

    def text_id(self) -> int:
        return TEXT_IDS[self.frames % len(TEXT_IDS)]

    def single(self) -> tuple[mx.array, mx.array]:
        """One frame alone, as ``Timeline.speak`` runs it."""
        t = self.text_id()
        hidden = self.tts.backbone_step(self.prev, mx.array([[t]], dtype=mx.int32), [self.cache], [t])
        codes = self.tts.generate_codes(hidden, [self.rng])
        mx.eval(hidden, codes)
        self._advance(codes)
        return hidden, codes

    def _advance(self, codes: mx.array) -> None:
        self.prev = codes
        self.frames += 1

    def copy(self) -> "Speaker":
        twin = object.__new__(Speaker)
        twin.tts, twin.prev, twin.frames = self.tts, self.prev, self.frames
        twin.cache = caches_from_state(copy_arrays(cache_state(self.cache)),
                                       cache_meta_state(self.cache))
        twin.rng = RandomStream.from_state(copy_arrays(self.rng.state))
        return twin


def batched(speakers: list[Speaker]) -> tuple[mx.array, mx.array]:
    """One frame of every speaker in one batch."""
    tts = speakers[0].tts
    ids = [s.text_id() for s in speakers]
    previous = mx.concatenate([s.prev for s in speakers], axis=0)
    text = mx.array(ids, dtype=mx.int32)[:, None]
    hidden = tts.backbone_step(previous, text, [s.cache for s in speakers], ids)
    codes = tts.generate_codes(hidden, [s.rng for s in speakers])
    mx.eval(hidden, codes)
    for b, s in enumerate(speakers):
        s._advance(codes[b : b + 1])
    return hidden, codes


def _speakers(model, prior=PRIOR_STEPS, seeds=SEEDS) -> list[Speaker]:
    speakers = [Speaker(model, seed) for seed in seeds]
    for speaker, steps in zip(speakers, prior):
        for _ in range(steps):
            speaker.single()
    return speakers


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b))


def _same_state(a: Speaker, b: Speaker) -> bool:
    if a.frames != b.frames or not _equal(a.rng.key, b.rng.key) or not _equal(a.prev, b.prev):
        return False
    for x, y in zip(a.cache, b.cache):
        if (x.offset, getattr(x, "_idx", None)) != (y.offset, getattr(y, "_idx", None)):
            return False
        if not all(_equal(p, q) for p, q in zip(x.state, y.state)):
            return False
    return True


def _check_frame(speakers: list[Speaker], alone: list[Speaker]) -> None:
    hidden, codes = batched(speakers)
    for b, twin in enumerate(alone):
        want_hidden, want_codes = twin.single()
        assert _equal(session_rows(hidden, b, len(speakers)), want_hidden), f"hidden of session {b}"
        assert _equal(codes[b : b + 1], want_codes), f"codes of session {b}"
        assert _same_state(speakers[b], twin), f"state of session {b}"


def test_sessions_start_at_different_positions_some_past_the_sliding_window(model):
    window = model.tts_model.tts_model.config.sliding_window
    offsets = [s.cache[0].offset for s in _speakers(model)]
    assert len(set(offsets)) == len(offsets)
    assert min(offsets) < window < max(offsets)


def test_consecutive_batched_frames_equal_each_sessions_single_frames(model):
    speakers = _speakers(model)
    alone = [s.copy() for s in speakers]
    for _ in range(4):
        _check_frame(speakers, alone)


def test_a_single_frame_after_batched_frames_continues_identically(model):
    speakers = _speakers(model)
    alone = [s.copy() for s in speakers]
    for _ in range(2):
        _check_frame(speakers, alone)
    for speaker, twin in zip(speakers, alone):
        hidden, codes = speaker.single()
        want_hidden, want_codes = twin.single()
        assert _equal(hidden, want_hidden) and _equal(codes, want_codes)
    _check_frame(speakers, alone)  # and batched again after the single frames


def test_sessions_join_and_leave_the_batch_between_frames(model):
    speakers = _speakers(model)
    alone = [s.copy() for s in speakers]
    for members in ((0, 1, 2), (1, 2, 3), (3, 0), (2,), (0, 1, 2, 3)):
        _check_frame([speakers[i] for i in members], [alone[i] for i in members])


def test_a_batch_of_one_is_the_single_call(model):
    speakers = _speakers(model, prior=(3,), seeds=(5,))
    _check_frame(speakers, [s.copy() for s in speakers])


def test_sessions_off_the_compiled_path_run_one_by_one_with_the_same_result(model, monkeypatch):
    speakers = _speakers(model, prior=(0, 4, 9), seeds=(1, 2, 3))
    alone = [s.copy() for s in speakers]
    monkeypatch.setattr(GemmaStep, "ready", lambda self, x, caches: caches is not speakers[1].cache)
    _check_frame(speakers, alone)


def test_mismatched_batch_shapes_are_refused_naming_the_field(model):
    speakers = _speakers(model, prior=(0, 0), seeds=(1, 2))
    tts = speakers[0].tts
    previous = mx.concatenate([s.prev for s in speakers], axis=0)
    text = mx.array([[3], [4]], dtype=mx.int32)
    caches = [s.cache for s in speakers]
    with pytest.raises(ValueError, match="text_ids"):
        tts.backbone_step(previous, text, caches, [3])
    with pytest.raises(ValueError, match="previous"):
        tts.backbone_step(previous[:1], text, caches, [3, 4])
    with pytest.raises(ValueError, match="text must be"):
        tts.backbone_step(previous, text[:1], caches, [3, 4])
    hidden = tts.backbone_step(previous, text, caches, [3, 4])
    with pytest.raises(ValueError, match="2 per session"):
        tts.generate_codes(hidden, [speakers[0].rng])


def test_per_row_keys_draw_what_each_key_draws_alone():
    keys = mx.stack([mx.random.key(s) for s in (0, 1, 2)])
    for sampler in (mx.random.uniform, mx.random.normal):
        rows = draw(sampler, (3, 1, 8), keys)
        for b, key in enumerate(keys):
            assert _equal(rows[b : b + 1], sampler(shape=(1, 1, 8), key=key))
    with pytest.raises(ValueError, match="2 keys for 3 rows"):
        draw(mx.random.uniform, (3, 1, 8), keys[:2])


def test_key_streams_without_take_are_drawn_key_by_key(model):
    speakers = _speakers(model, prior=(2, 6), seeds=(4, 9))
    alone = [s.copy() for s in speakers]
    tts = speakers[0].tts
    previous = mx.concatenate([s.prev for s in speakers], axis=0)
    ids = [s.text_id() for s in speakers]
    hidden = tts.backbone_step(previous, mx.array(ids, dtype=mx.int32)[:, None],
                                     [s.cache for s in speakers], ids)
    codes = tts.generate_codes(hidden, [SimpleNamespace(next=s.rng.next) for s in speakers])
    for b, twin in enumerate(alone):
        _, want_codes = twin.single()
        assert _equal(codes[b : b + 1], want_codes)
        assert _equal(speakers[b].rng.key, twin.rng.key)


def test_many_key_streams_take_their_keys_in_one_computation_exactly():
    import numpy as np

    from mlx_voicechat_plugin.runtime.rng import KeyRows

    together = [RandomStream(seed) for seed in (0, 5, 2**64 - 1)]
    alone = [RandomStream(seed) for seed in (0, 5, 2**64 - 1)]
    rows = KeyRows.merge(together)
    for count in (10, 10, 4):
        many = rows.take(count)
        one = mx.stack([s.take(count) for s in alone])
        assert np.array_equal(np.array(many), np.array(one))
    for b in range(2):
        assert np.array_equal(np.array(rows.remove(0)), np.array(alone[b].key))
    assert np.array_equal(np.array(rows.keys), np.array(alone[2].key[None]))


def test_a_batch_holds_its_rows_keys_stacked_and_gives_each_back_on_removal():
    """A batch's keys are one stacked array while its rows draw together (their streams
    hold none), each row's draws its own; a removed row takes its key back exactly."""
    import numpy as np

    from mlx_voicechat_plugin.runtime.rng import KeyRows

    seeds = (0, 5, 2**64 - 1)
    together = [RandomStream(seed) for seed in seeds]
    alone = [RandomStream(seed) for seed in seeds]
    rows = KeyRows.merge(together)
    assert len(rows) == 3 and all(s.key is None and s.state == [] for s in together)
    for count in (4, 6, 6):
        many = rows.take(count)
        one = mx.stack([s.take(count) for s in alone])
        assert np.array_equal(np.array(many), np.array(one))
    together[1].key = rows.remove(1)
    assert len(rows) == 2 and np.array_equal(np.array(together[1].key), np.array(alone[1].key))
    assert np.array_equal(np.array(together[1].take(2)), np.array(alone[1].take(2)))
    rows = KeyRows.merge([rows, together[1]])  # appended after the others
    check = mx.stack([alone[b].take(3) for b in (0, 2, 1)])
    assert np.array_equal(np.array(rows.take(3)), np.array(check))
    together[2].state = []  # released
    assert together[2].key is None and together[2].state == []
