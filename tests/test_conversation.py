"""One conversation loop for offline and streaming: the same events, state as one list,
sessions that leave the model untouched, and a detokenizer linear in the stream."""

from __future__ import annotations

import ast
import dataclasses
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tool_support import RESULT, VALID, WEATHER, Script, short_tool_prompt

from mlx_voicechat_plugin.runtime.events import (
    AssistantTextDelta,
    Audio,
    Done,
    FunctionDelta,
    TokenText,
    ToolCall,
    ToolCallInvalid,
    ToolResultInjected,
    ToolsWarning,
    UserTranscriptDelta,
    ids_decoder,
)
from mlx_voicechat_plugin.runtime.options import ConversationOptions
from mlx_voicechat_plugin.runtime.tools import RECOMMENDED_MAX_TOOLS
from mlx_voicechat_plugin.testing.fixtures import question_signal

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_voicechat_plugin"
BOOKS = (AssistantTextDelta, FunctionDelta, UserTranscriptDelta, ToolCall, ToolCallInvalid,
         ToolResultInjected, ToolsWarning)


@pytest.fixture(scope="module")
def session(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    return model.create_session(processor)


def _books(events, frames: int) -> list:
    """The bookkeeping events before ``frames``, call ids numbered in order (they are random)."""
    ids: dict[str, str] = {}
    kept = []
    for e in events:
        if isinstance(e, BOOKS) and e.frame_index < frames:
            if isinstance(e, (ToolCall, ToolResultInjected)):
                e = dataclasses.replace(e, call_id=ids.setdefault(e.call_id, f"call_{len(ids)}"))
            kept.append(e)
    return kept


def _stream(session, audio, response: str | None = None, **options):
    stream = session.create_streaming_session(**options)
    events = []
    for start in range(0, len(audio), 1280):
        chunk = stream.push_audio(audio[start : start + 1280])
        events += chunk
        for call in (e for e in chunk if isinstance(e, ToolCall)):
            if response is not None:
                stream.submit_tool_result(call.call_id, response)
    return stream, events + stream.flush()


def test_offline_and_streaming_emit_the_same_event_sequence(session, monkeypatch):
    """Text, function, transcript and tool events agree frame for frame; offline has
    one frame more at the end (its centred mel, conformance/README.md)."""
    short_tool_prompt(monkeypatch)
    pad = session.config.pad_token_id
    audio = np.concatenate([question_signal(1.5), np.zeros(128000, np.float32)])
    options = dict(tools=[WEATHER], seed=4, system_prompt="Be brief.")
    Script(session.tokenizer, pad, VALID, start=3).install(monkeypatch)
    offline = session.generate(audio, extra_decoding_seconds=0.0, tool_response=RESULT, **options)
    Script(session.tokenizer, pad, VALID, start=3).install(monkeypatch)
    stream, streamed = _stream(session, audio, RESULT, **options)
    frames = stream.frame_index
    assert len(offline.text_tokens) == frames + 1
    assert _books(offline.events, frames) == _books(streamed, frames)
    kinds = {type(e) for e in _books(streamed, frames)}
    assert {ToolCall, ToolResultInjected, UserTranscriptDelta} <= kinds
    codes = np.stack([e.audio_codes for e in streamed if isinstance(e, Audio)])
    assert np.array_equal(offline.audio_codes[:frames], codes)
    assert isinstance(offline.events[-1], Done) and isinstance(streamed[-1], Done)


def test_offline_has_the_streaming_tool_limits_and_events(session, monkeypatch):
    short_tool_prompt(monkeypatch)
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    two = f"<TOOLCALL>[{call}, {call}]</TOOLCALL>"
    Script(session.tokenizer, session.config.pad_token_id, two, start=2).install(monkeypatch)
    result = session.generate(question_signal(0.5), tools=[WEATHER], max_tool_calls_per_turn=1,
                              extra_decoding_seconds=10.0)
    assert len(result.tool_calls) == 1
    assert [e.reason for e in result.tool_errors] == ["limit"]
    assert result.tool_errors == [e for e in result.events if isinstance(e, ToolCallInvalid)]


def test_offline_turn_reports_tool_set_warnings(session, monkeypatch):
    short_tool_prompt(monkeypatch)
    many = [{**WEATHER, "name": f"tool_{i}"} for i in range(RECOMMENDED_MAX_TOOLS + 1)]
    result = session.generate(question_signal(0.3), tools=many, extra_decoding_seconds=0.0)
    _, events = _stream(session, question_signal(0.3), tools=many)
    offline_warnings = [e for e in result.events if isinstance(e, ToolsWarning)]
    assert len(offline_warnings) == 1
    assert offline_warnings == [e for e in events if isinstance(e, ToolsWarning)]


def test_options_are_validated_once_for_both_paths(session):
    for bad in (dict(seed=-1), dict(max_tools=0), dict(max_tool_calls_per_turn=True),
                dict(max_streaming_seconds=float("nan")), dict(max_prompt_tokens=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ConversationOptions(**bad)
        with pytest.raises(ValueError, match=next(iter(bad))):
            session.create_streaming_session(**bad)
    with pytest.raises(ValueError, match="seed"):
        session.generate(question_signal(0.2), seed=-1)


# --- state -------------------------------------------------------------------


def test_state_is_one_list_sized_in_bytes_and_released_on_exit(session):
    stream = session.create_streaming_session()
    stream.push_audio(question_signal(0.5))
    state = stream.conversation.compute
    arrays = state.state
    assert arrays and all(isinstance(a, mx.array) for a in arrays)
    parts = (state.perception.state, state.timeline.state, state.rnnt.state, state.codec.state)
    assert all(parts), "every holder contributes arrays"
    assert state.nbytes == sum(a.nbytes for a in arrays) > 0
    assert stream.nbytes >= state.nbytes
    stream.cancel()
    assert state.state == [] and state.nbytes == 0 and stream.nbytes == 0


def test_state_is_released_by_flush(session):
    stream = session.create_streaming_session()
    stream.push_audio(question_signal(0.2))
    stream.flush()
    assert stream.conversation.compute.nbytes == 0


def _model_fingerprint(model) -> dict:
    return {k: id(v) for k, v in vars(model).items()}


def test_creating_sessions_does_not_change_the_model(tiny_ckpt):
    from mlx_voicechat_plugin import load

    model, processor = load(tiny_ckpt)
    before = _model_fingerprint(model)
    vocabulary = model.tts_model.tts_model.embed_subword.__dict__.copy()
    session = model.create_session(processor)
    session.create_streaming_session(system_prompt="Hi.").cancel()
    session.generate(question_signal(0.2), extra_decoding_seconds=0.0)
    assert _model_fingerprint(model) == before
    assert model.tts_model.tts_model.embed_subword.__dict__.keys() == vocabulary.keys()


def test_a_model_not_prepared_for_the_tokenizer_is_refused(tiny_ckpt):
    from mlx_voicechat_plugin import load
    from mlx_voicechat_plugin.loader import load_tokenizer

    model, _ = load(tiny_ckpt, lazy=True)
    with pytest.raises(ValueError, match="processor: the model was not prepared"):
        model.create_session(load_tokenizer(tiny_ckpt))


# --- the streaming detokenizer ----------------------------------------------------


class CountingTokenizer:
    """Wraps a tokenizer, counting the tokens each ``decode`` reads."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def _reference_rule(tokenizer, ids):
    """The reference's rule: decode everything; delta = new suffix, else the token's own text."""
    text, out = "", []
    for n, token in enumerate(ids):
        full = tokenizer.decode(ids[: n + 1], skip_special_tokens=False)
        delta = full[len(text):] if full.startswith(text) else \
            tokenizer.decode([token], skip_special_tokens=False)
        text = full
        out.append((delta, full))
    return out


@pytest.mark.parametrize("kind", ["random ids", "multilingual text"])
def test_streaming_detokenizer_equals_full_decode_over_a_long_stream(session, kind):
    tokenizer = session.tokenizer
    if kind == "random ids":
        rng = random.Random(0)
        ids = [rng.randrange(len(tokenizer)) for _ in range(1500)]
    else:
        ids = tokenizer.encode("Grüße, señor! It's 21 °C in Zürich; 東京は晴れ. " * 40,
                               add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    text = TokenText(counting, frozenset())
    assert [text.append(i) for i in ids] == _reference_rule(tokenizer, ids)
    # Linear: a bounded window per token, not the whole channel (~n^2 / 2 tokens).
    assert counting.decoded <= 4 * (TokenText.CONTEXT_TOKENS + 2) * len(ids)


def test_a_transformers_tokenizer_is_decoded_directly_with_decodes_text(session, monkeypatch):
    """The books skip ``decode``'s input conversion for a transformers tokenizer (its
    ``_decode`` of the same ids), and give ``decode``'s text: window by window over a
    long multilingual stream, and as one channel's deltas (the reference's rule)."""
    tokenizer = session.tokenizer
    ids = tokenizer.encode("Grüße, señor! It's 21 °C in Zürich; 東京は晴れ. " * 10,
                           add_special_tokens=False) + sorted(session.config.special_text_ids)
    direct = ids_decoder(tokenizer)
    for start in range(0, len(ids), 7):
        for end in (start + 1, start + 9, len(ids)):
            assert direct(ids[start:end]) == tokenizer.decode(ids[start:end],
                                                              skip_special_tokens=False)
    expected = _reference_rule(tokenizer, ids)
    text = TokenText(tokenizer, frozenset())
    monkeypatch.setattr(type(tokenizer), "decode", None)  # the books must not call it
    assert [text.append(i) for i in ids] == expected


def test_a_tokenizer_with_its_own_decode_is_called_through_it(session):
    counting = CountingTokenizer(session.tokenizer)
    assert ids_decoder(counting)([1, 2, 3]) == session.tokenizer.decode([1, 2, 3])
    assert counting.decoded > 0


def test_hidden_tokens_are_not_decoded(session):
    hidden = session.config.special_text_ids
    text = TokenText(session.tokenizer, hidden)
    assert all(text.append(i) is None for i in hidden)
    assert text.text == "" and text.tokens == []


# --- the import graph ---------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    """Intra-package modules a file imports at run time (``TYPE_CHECKING`` blocks excluded)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", None) == "TYPE_CHECKING"
               for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
        names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
        found.update(names)
    return found


def _graph(folder: str) -> dict[str, set[str]]:
    return {f"mlx_voicechat_plugin.{folder}.{p.stem}": _imports(p)
            for p in (PACKAGE / folder).glob("*.py")}


def test_runtime_imports_have_no_cycle():
    graph = _graph("runtime")
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in graph.get(node, ()):
            if state.get(target) == 1:
                raise AssertionError(" -> ".join(path + [target]))
            if target in graph and not state.get(target):
                visit(target, path + [target])
        state[node] = 2

    for node in graph:
        if not state.get(node):
            visit(node, [node])


def test_models_import_no_runtime_and_create_session_names_the_runtime():
    uses = {name: sorted(t for t in targets if ".runtime" in t)
            for name, targets in _graph("models").items()}
    assert {k: v for k, v in uses.items() if v} == {}
    import importlib

    from mlx_voicechat_plugin.models import model
    from mlx_voicechat_plugin.runtime.voicechat import VoiceChat

    module, name = model.RUNTIME  # model.create_session(processor) makes one, found by name
    assert getattr(importlib.import_module(module, model.__package__), name) is VoiceChat
    assert not hasattr(model.Model, "runtime")  # nothing set on the class by an import
