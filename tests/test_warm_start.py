"""Session start: the EAR-TTS warm-up is computed once per runtime and copied.

The runtime (``model.create_session(processor)``) computes it when it is
made, or reads back the one remembered for its checkpoint; nothing of it lives
on the model.

The warm-up caches are a pure function of the weights; each session gets new
cache objects over them, so sessions start without recomputing it and never
see each other's cache writes.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlx_voicechat_plugin.models.speech.ear_tts import EarTTS
from mlx_voicechat_plugin.models.remembered import ENV_CACHE_DIR
from mlx_voicechat_plugin.runtime.events import Audio, AssistantTextDelta
from mlx_voicechat_plugin.testing.fixtures import question_signal


@pytest.fixture
def session(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


def _run(session, seed: int = 3):
    stream = session.create_streaming_session(seed=seed)
    audio = question_signal(0.6)
    events = []
    for start in range(0, len(audio), 1280):
        events += stream.push_audio(audio[start : start + 1280])
    events += stream.flush()
    codes = np.stack([e.audio_codes for e in events if isinstance(e, Audio)])
    return codes, [e.token_id for e in events if isinstance(e, AssistantTextDelta)]


def test_the_warm_up_runs_once_per_runtime_when_it_is_made(session, monkeypatch):
    assert session.warm_start is not None  # computed when the runtime was made
    calls = []
    warmup = EarTTS.warmup

    def counted(self, *args, **kwargs):
        calls.append(1)
        return warmup(self, *args, **kwargs)

    monkeypatch.setattr(EarTTS, "warmup", counted)
    for _ in range(3):
        session.create_streaming_session()
    session.generate(question_signal(0.3), extra_decoding_seconds=0.0)
    assert not calls  # no session or turn runs it again
    session.warm_start = None
    session.create_streaming_session()
    session.create_streaming_session()
    assert not calls  # once dropped, it is read back once, lazily, as remembered
    monkeypatch.setenv(ENV_CACHE_DIR, "off")
    session.warm_start = None
    session.create_streaming_session()
    session.create_streaming_session()
    assert len(calls) == 1  # with remembering off, it is computed again once, lazily


def test_sessions_from_the_shared_warm_start_equal_a_fresh_warm_up(session):
    first = _run(session)
    second = _run(session)  # the shared start after a session wrote into its copies
    session.warm_start = None  # force a fresh warm-up
    fresh = _run(session)
    for other in (second, fresh):
        assert np.array_equal(first[0], other[0]) and first[1] == other[1]
