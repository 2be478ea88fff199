"""``turn_events``: the text channel's end-of-turn token as a ``TurnEnded`` event.

The GA dialect ends a response at the model's EOS; the runtime reports it only
to sessions that ask, so the mlx-vlm events stay the reference's.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlx_voicechat_plugin import load
from mlx_voicechat_plugin.runtime.events import TurnEnded
from mlx_voicechat_plugin.testing.fixtures import question_signal


@pytest.fixture(scope="module")
def voicechat(tiny_ckpt):
    model, processor = load(str(tiny_ckpt))
    return model.create_session(processor)


def _run(voicechat, **options) -> tuple[list, list[int]]:
    """Every event of a 2 s stream, and the frames whose text token was EOS."""
    stream = voicechat.create_streaming_session(**options)
    signal = question_signal(2.0)
    events, eos_frames = [], []
    for start in range(0, signal.shape[0], stream.frame_samples):
        events += stream.push_audio(signal[start : start + stream.frame_samples])
        out = stream.conversation.last_output
        if out is not None and out.text_id == voicechat.config.eos_token_id:
            eos_frames.append(stream.frame_index - 1)
    stream.flush()
    return events, eos_frames


def test_turn_ended_marks_exactly_the_frames_whose_text_token_is_eos(voicechat):
    events, eos_frames = _run(voicechat, turn_events=True)
    assert eos_frames  # the tiny model ends turns often
    assert [e.frame_index for e in events if isinstance(e, TurnEnded)] == eos_frames


def test_without_turn_events_the_events_are_unchanged(voicechat):
    plain, _ = _run(voicechat)
    marked, _ = _run(voicechat, turn_events=True)
    assert not [e for e in plain if isinstance(e, TurnEnded)]
    rest = [e for e in marked if not isinstance(e, TurnEnded)]
    assert [type(e) for e in rest] == [type(e) for e in plain]
    assert all(getattr(a, "text", None) == getattr(b, "text", None) for a, b in zip(rest, plain))
    audio = [e.samples for e in rest if hasattr(e, "samples")]
    assert np.array_equal(np.concatenate(audio),
                          np.concatenate([e.samples for e in plain if hasattr(e, "samples")]))
