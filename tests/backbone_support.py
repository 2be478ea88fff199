"""The EAR-TTS backbone run two ways, frame by frame, for specifications that compare them."""

from __future__ import annotations

from typing import Any, Iterator

import mlx.core as mx

from mlx_voicechat_plugin.runtime.timeline import Timeline


def backbone_steps(model: Any, start: Any, steps: int = 4) -> Iterator[tuple[Any, mx.array, mx.array]]:
    """``(step, plain backbone hidden, compiled step hidden)`` for ``steps`` frames of one
    conversation: the plain backbone (``_run_backbone``) on one timeline's caches, the
    compiled one-position step (``backbone_step``) on another's."""
    tts = model.tts_model.tts_model
    plain, fast = Timeline(model, start), Timeline(model, start)
    text = mx.array([[7]], dtype=mx.int32)
    for _ in range(steps):
        codes = plain.prev_codes
        expected = tts._run_backbone(
            tts.embed_code(tts.embed_codes(codes)),
            tts._with_uncond(tts.embed_subword(text, mx.ones(text.shape, dtype=mx.bool_))),
            plain.tts_caches[0],
        )
        got = tts.backbone_step(codes, text, fast.tts_caches)
        assert tts._backbone_step.ready(codes, fast.tts_caches[0])
        yield tts._backbone_step, expected, got
