"""How NVIDIA's VoiceChat dialect turns a session's runtime events into its events.

Synthetic runtime events, one 80 ms frame at a time, through
:class:`Conversation` (the live protocol: test_server_nvidia.py).
"""

from __future__ import annotations

import json

import numpy as np
from prometheus_client import CollectorRegistry

from mlx_voicechat_plugin.runtime.events import (
    AssistantTextDelta, Audio, ToolCall, TurnEnded, UserTranscriptDelta,
)
from mlx_voicechat_plugin.server.dialects.nvidia.events import (
    PACKET_BYTES, USER_PAUSE_FRAMES, Conversation, Counters,
)
from mlx_voicechat_plugin.server.engine.client_metrics import ClientMetrics
from mlx_voicechat_plugin.server.transport.websocket import serialize


def frame(index: int, **extra) -> list:
    events = [Audio(index, np.zeros(1764, np.float32), 22_050, np.zeros(31, np.int32))]
    if "user" in extra:
        events.append(UserTranscriptDelta(index, extra["user"], extra["user"]))
    if "text" in extra:
        events.append(AssistantTextDelta(index, 7, extra["text"], extra["text"]))
    if extra.get("eos"):
        events.append(TurnEnded(index))
    if extra.get("call"):
        events.append(ToolCall(index, "call_" + "ab" * 16, "get_weather", '{"city": "Paris"}'))
    return events


def kinds(messages) -> list[str]:
    return [json.loads(serialize(m))["type"] for m in messages]


def test_user_turn_events():
    book = Conversation(22_050, Counters())
    out = book.translate(frame(0, user="hel")) + book.translate(frame(1, user="lo"))
    assert [k for k in kinds(out) if not k.startswith("response.")] == [
        "input_audio_buffer.speech_started",
        "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.delta"]
    quiet = [m for i in range(USER_PAUSE_FRAMES) for m in book.translate(frame(2 + i))]
    assert [k for k in kinds(quiet) if not k.startswith("response.")] == [
        "conversation.item.input_audio_transcription.completed",
        "input_audio_buffer.speech_stopped"]
    completed = [json.loads(serialize(m)) for m in quiet
                 if kinds([m])[0].endswith("completed")]
    assert completed[0]["transcript"] == "hello"


def test_assistant_transcript_per_turn():
    book = Conversation(22_050, Counters())
    out = book.translate(frame(0, text="Hi")) + book.translate(frame(1, text=" there", eos=True))
    out += book.translate(frame(2, text="Again", eos=True))
    done = [json.loads(serialize(m)) for m in out
            if kinds([m])[0] == "response.output_audio_transcript.done"]
    assert [d["transcript"] for d in done] == ["Hi there", "Again"]
    assert kinds(out).count("response.output_audio_transcript.delta") == 3


def test_assistant_speech_ends_the_user_turn():
    book = Conversation(22_050, Counters())
    book.translate(frame(0, user="hi"))
    out = kinds(book.translate(frame(1, text="Hello")))
    assert out.index("input_audio_buffer.speech_stopped") < out.index(
        "response.output_audio_transcript.delta")


def test_tool_call_event():
    book = Conversation(22_050, Counters())
    out = [json.loads(serialize(m)) for m in book.translate(frame(0, call=True))]
    call = [e for e in out if e["type"] == "response.function_call_arguments.done"][0]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_")


def test_packets_are_exactly_80_ms_and_the_tail_is_padded():
    counters = Counters()
    book = Conversation(22_050, counters)
    out = [m for i in range(10) for m in book.translate(frame(i))] + book.finish()
    packets = [m for m in out if kinds([m])[0] == "response.output_audio.delta"]
    assert all(len(p.data) == PACKET_BYTES for p in packets)
    assert abs(len(packets) - 10) <= 1 and counters.chunks_sent == len(packets)
    assert counters.inferences == 10
    assert kinds(out)[-1] == "response.done"


def test_response_latency_from_the_end_of_speech_to_audible_output():
    registry = CollectorRegistry()
    book = Conversation(22_050, Counters(metrics=ClientMetrics(registry)))
    book.translate(frame(0, user="hi"))
    for i in range(USER_PAUSE_FRAMES + 2):  # the turn ends; silence is no answer
        book.translate(frame(1 + i))
    count = "voicechat_client_response_latency_seconds_count"
    assert not registry.get_sample_value(count, {"dialect": "nvidia"})
    loud = [Audio(20, np.full(1764, 0.5, np.float32), 22_050, np.zeros(31, np.int32))]
    book.translate(loud)
    book.translate(frame(21))
    assert registry.get_sample_value(count, {"dialect": "nvidia"}) == 1
