"""A conversation's host books stay bounded: cumulative texts, transcripts, tool-call books.

Bounded, each channel's ``text`` is the unbounded text's last ``keep`` to
``2 * keep`` characters and every delta is the unbounded one; tool calls
are parsed across the cuts as without them; the call books forget their
oldest entries past a fixed count.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from mlx_voicechat_plugin.models.rnnt.rnnt import RNNTState
from mlx_voicechat_plugin.runtime import tool_calls
from mlx_voicechat_plugin.runtime.events import TokenText, ToolCall
from mlx_voicechat_plugin.runtime.tool_calls import ToolChannel
from mlx_voicechat_plugin.runtime.tools import ToolError, ToolSet

KEEP = 64


@pytest.fixture(scope="module")
def session(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


def test_a_bounded_channel_text_is_a_suffix_with_the_same_deltas(session):
    tokenizer = session.tokenizer
    rng = random.Random(1)
    ids = [rng.randrange(len(tokenizer)) for _ in range(3000)]
    whole, bounded = TokenText(tokenizer, frozenset()), TokenText(tokenizer, frozenset(), KEEP)
    longest = 0
    for token in ids:
        full, part = whole.append(token), bounded.append(token)
        assert full[0] == part[0]  # the delta
        assert full[1].endswith(part[1]) and len(full[1]) - len(part[1]) == bounded.dropped
        longest = max(longest, len(part[1]))
    assert bounded.dropped > 10 * KEEP  # cut many times
    assert longest <= 2 * KEEP + 64 and len(bounded.tokens) <= 4 * KEEP


def test_a_bounded_transcript_is_a_suffix_with_the_same_deltas(session):
    vocabulary = list(session.config.rnnt_vocabulary)
    greedy = SimpleNamespace(blank_id=session.config.rnnt_blank_id)
    whole = RNNTState(greedy, vocabulary)
    bounded = RNNTState(greedy, vocabulary, keep_chars=KEEP)
    rng = random.Random(2)
    symbols = [s for s in range(len(vocabulary)) if s != greedy.blank_id]
    for _ in range(2000):
        frame = [rng.choice(symbols) for _ in range(rng.randrange(1, 3))]
        assert whole.commit(frame) == bounded.commit(frame)
        assert whole.text.endswith(bounded.text)
        assert len(bounded.text) <= 2 * KEEP + 16 and len(bounded.tokens) <= 2 * KEEP + 4
    assert len(whole.text) > 10 * KEEP


WEATHER = {"name": "get_weather", "description": "Weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _calls(channel: ToolChannel, text: TokenText, pieces: list[str]) -> list[tuple]:
    out = []
    for frame, piece in enumerate(pieces):
        token = text.tokenizer.encode(piece, add_special_tokens=False)
        for t in token:
            if text.append(t) is None:
                continue
            for event in channel.observe(text.text, frame, text.dropped):
                out.append((type(event).__name__, getattr(event, "name", None),
                            getattr(event, "arguments", None), event.frame_index))
    return out


def test_tool_calls_parse_across_the_cuts_of_a_bounded_function_channel(session):
    tokenizer = session.tokenizer
    call = "<TOOLCALL>" + json.dumps([{"name": "get_weather", "arguments": {"city": "Oslo"}}]) \
        + "</TOOLCALL>"
    pieces = []
    for i in range(30):
        pieces += [f" filler words {i} and more"] * 3 + [call]
    tools = ToolSet([WEATHER])
    channels = [ToolChannel(tools, tokenizer, max_calls_per_turn=100) for _ in range(2)]
    whole = _calls(channels[0], TokenText(tokenizer, frozenset()), pieces)
    bounded_text = TokenText(tokenizer, frozenset(), KEEP * 2)
    bounded = _calls(channels[1], bounded_text, pieces)
    assert bounded_text.dropped > 0 and len(whole) == 30
    assert bounded == whole


def test_the_call_books_forget_their_oldest_entries(session, monkeypatch):
    monkeypatch.setattr(tool_calls, "MAX_PENDING_CALLS", 3)
    monkeypatch.setattr(tool_calls, "MAX_ANSWERED_CALLS", 2)
    channel = ToolChannel(ToolSet([WEATHER]), session.tokenizer, max_calls_per_turn=100)
    call = "<TOOLCALL>" + json.dumps([{"name": "get_weather", "arguments": {}}]) + "</TOOLCALL>"
    text = ""
    ids = []
    for i in range(6):
        text += call
        ids += [e.call_id for e in channel.observe(text, i) if isinstance(e, ToolCall)]
    assert list(channel.pending) == ids[-3:]
    with pytest.raises(ToolError, match="unknown"):
        channel.submit(ids[0], "{}")  # forgotten
    for call_id in ids[-3:]:
        channel.submit(call_id, "{}")
    assert list(channel.answered) == ids[-2:]
    with pytest.raises(ToolError, match="already has a result"):
        channel.submit(ids[-1], "{}")
