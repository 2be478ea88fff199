"""How the GA dialect turns a full-duplex timeline into responses and items.

Synthetic runtime events, one 80 ms frame at a time, through
:class:`GAResponses`; each rule of the mapping is one test.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from mlx_voicechat_plugin.runtime.events import (
    AssistantTextDelta,
    Audio,
    Done,
    ToolCall,
    TurnEnded,
    UserTranscriptDelta,
)
from mlx_voicechat_plugin.server.dialects.ga.config import GAConfig
from mlx_voicechat_plugin.server.transport.websocket import serialize
from mlx_voicechat_plugin.server.dialects.ga.responses import (
    RESPONSE_GAP_SECONDS,
    TAIL_FRAMES,
    GAResponses,
)

FRAME_SECONDS = 0.08
GAP = round(RESPONSE_GAP_SECONDS / FRAME_SECONDS)
SILENCE = round(0.8 / FRAME_SECONDS)  # the default silence_duration_ms


class Timeline:
    """Feeds frames to a :class:`GAResponses`; keeps every GA event it produced."""

    def __init__(self, config: GAConfig | None = None):
        self.responses = GAResponses(config or GAConfig())
        self.frame = 0
        self.events: list[dict] = []

    def step(self, text: str | None = None, user: str | None = None, call: bool = False,
             eos: bool = False):
        frame, events = self.frame, []
        if frame:  # a frame's audio leaves with the next frame
            events.append(Audio(frame - 1, np.zeros(1764, np.float32), 22_050,
                                np.zeros(31, np.int32)))
        if user is not None:
            events.append(UserTranscriptDelta(frame, user, user))
        if text is not None:
            events.append(AssistantTextDelta(frame, 7, text, text))
        if eos:
            events.append(TurnEnded(frame))
        if call:
            events.append(ToolCall(frame, "call_" + "ab" * 16, "get_weather",
                                   '{"city": "Paris"}'))
        self.frame += 1
        out = [json.loads(serialize(m)) for m in self.responses.translate(events)]
        self.events += out
        return out

    def idle(self, frames: int):
        return [e for _ in range(frames) for e in self.step()]

    def kinds(self, events=None):
        return [e["type"] for e in (self.events if events is None else events)]


def test_audio_before_any_text_is_not_sent():
    timeline = Timeline()
    assert timeline.idle(5) == []


def test_the_first_text_token_opens_a_response_before_its_audio():
    timeline = Timeline()
    timeline.idle(2)
    opened = timeline.step(text="Hi")
    assert timeline.kinds(opened) == [
        "response.created", "response.output_item.added", "conversation.item.added",
        "response.content_part.added", "response.output_audio_transcript.delta"]
    assert opened[0]["response"]["status"] == "in_progress"
    assert opened[1]["item"]["role"] == "assistant"
    audio = timeline.step()
    assert timeline.kinds(audio) == ["response.output_audio.delta"]
    assert audio[0]["item_id"] == opened[1]["item"]["id"]
    assert audio[0]["response_id"] == opened[0]["response"]["id"]


def test_a_pause_without_text_ends_the_response_with_its_transcript_and_usage():
    timeline = Timeline()
    timeline.step(text="Hel")
    timeline.step(text="lo")
    closing = timeline.idle(GAP + 1)
    kinds = timeline.kinds(closing)
    tail = kinds[kinds.index("response.output_audio.done"):]
    assert tail == ["response.output_audio.done", "response.output_audio_transcript.done",
                    "response.content_part.done", "conversation.item.done",
                    "response.output_item.done", "response.done"]
    by_kind = {e["type"]: e for e in closing}
    assert by_kind["response.output_audio_transcript.done"]["transcript"] == "Hello"
    done = by_kind["response.done"]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": "Hello"}]
    usage = done["usage"]
    # frames 0..GAP spoke (frame GAP + 1 is the first past the pause); one audio token a frame
    assert usage["output_token_details"] == {"text_tokens": 2, "audio_tokens": GAP + 1}
    assert usage["output_tokens"] == 2 + GAP + 1
    assert usage["input_tokens"] == GAP + 2  # the frames heard while it was open


def test_a_tool_call_is_a_function_call_item_that_ends_the_response():
    timeline = Timeline()
    timeline.step(text="Let me check")
    out = timeline.step(call=True)
    kinds = timeline.kinds(out)
    start = kinds.index("response.output_item.added")
    assert kinds[start:] == [
        "response.output_item.added", "conversation.item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "conversation.item.done", "response.output_item.done", "response.done"]
    done = out[-1]["response"]
    assert [item["type"] for item in done["output"]] == ["message", "function_call"]
    call = done["output"][1]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert len(call["call_id"]) <= 32
    assert timeline.responses.runtime_call_id(call["call_id"]) == "call_" + "ab" * 16


def test_a_tool_call_without_speech_is_a_response_of_its_own():
    timeline = Timeline()
    out = timeline.step(call=True)
    assert timeline.kinds(out)[0] == "response.created"
    assert [i["type"] for i in out[-1]["response"]["output"]] == ["function_call"]


def test_user_speech_is_one_item_between_speech_started_and_stopped():
    timeline = Timeline()
    started = timeline.step(user="what")
    assert timeline.kinds(started) == ["input_audio_buffer.speech_started",
                                       "conversation.item.input_audio_transcription.delta"]
    item_id = started[0]["item_id"]
    timeline.step(user=" time")
    stopped = timeline.idle(SILENCE + 1)
    assert timeline.kinds(stopped) == [
        "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
        "conversation.item.added", "conversation.item.done",
        "conversation.item.input_audio_transcription.completed"]
    assert all(e.get("item_id", e.get("item", {}).get("id")) == item_id for e in stopped)
    assert stopped[-1]["transcript"] == "what time"
    assert stopped[0]["audio_end_ms"] == 160


def test_without_turn_detection_the_client_commit_ends_the_user_item():
    timeline = Timeline(GAConfig(turn_detection=None))
    assert timeline.kinds(timeline.step(user="hi")) == [
        "conversation.item.input_audio_transcription.delta"]
    assert timeline.idle(SILENCE + 2) == []
    committed = timeline.responses.commit()
    assert [e["type"] for e in committed][0] == "input_audio_buffer.committed"
    assert committed[-1]["transcript"] == "hi"


def test_commit_without_speech_is_acknowledged_with_a_new_item():
    (committed,) = Timeline().responses.commit()
    assert committed["type"] == "input_audio_buffer.committed"
    assert committed["item_id"].startswith("item_")


def test_cancel_ends_the_response_and_mutes_the_rest_of_the_utterance():
    timeline = Timeline()
    timeline.step(text="Long")
    cancelled = timeline.responses.cancel()
    assert cancelled[-1]["response"]["status"] == "cancelled"
    assert cancelled[-1]["response"]["status_details"]["reason"] == "client_cancelled"
    assert timeline.step(text=" story") == []  # the same utterance goes on, unheard
    timeline.idle(GAP)
    again = timeline.step(text="Next")
    assert timeline.kinds(again)[0] == "response.created"


def test_cancel_without_a_response_is_refused():
    assert Timeline().responses.cancel() is None


def test_response_create_opens_a_response_at_once_that_the_next_utterance_fills():
    timeline = Timeline()
    (created,) = timeline.responses.request({"metadata": {"client_event_id": "abc"}})
    assert created["type"] == "response.created"
    assert created["response"]["metadata"] == {"client_event_id": "abc"}
    timeline.idle(GAP + 3)  # the model has not spoken yet: the response waits
    opened = timeline.step(text="Hi")
    assert timeline.kinds(opened)[0] == "response.output_item.added"
    assert opened[0]["response_id"] == created["response"]["id"]


def test_response_create_while_one_is_active_opens_the_next_response_when_it_is_done():
    timeline = Timeline()
    timeline.step(text="Hi")  # the model began on its own
    assert timeline.responses.request({"metadata": {"n": "asked"}}) == []
    ended = timeline.idle(GAP + 3)
    kinds = timeline.kinds(ended)
    assert kinds.index("response.done") < kinds.index("response.created")
    (created,) = [e for e in ended if e["type"] == "response.created"]
    assert created["response"]["metadata"] == {"n": "asked"}
    assert timeline.responses.owes  # the asked-for response is owed: the timeline runs


def test_a_second_waiting_response_create_is_refused():
    timeline = Timeline()
    timeline.step(text="Hi")
    assert timeline.responses.request({}) == []
    assert timeline.responses.request({}) is None


def test_a_request_waiting_at_the_end_of_the_stream_gets_its_response_done():
    timeline = Timeline()
    timeline.step(text="Bye")
    timeline.responses.request({"metadata": {"n": "late"}})
    out = [json.loads(serialize(m)) for m in timeline.responses.translate([Done(1)])]
    kinds = [e["type"] for e in out]
    assert kinds.count("response.created") == 1 and kinds.count("response.done") == 2
    assert out[-1]["response"]["metadata"] == {"n": "late"}
    assert out[-1]["response"]["status"] == "cancelled"
    assert not timeline.responses.owes


def test_the_end_of_turn_token_ends_the_response_after_its_audio_tail():
    timeline = Timeline()
    timeline.step(text="Hi")
    timeline.step(eos=True)  # frame 1
    tail = timeline.idle(TAIL_FRAMES + 1)
    kinds = timeline.kinds(tail)
    assert kinds.count("response.output_audio.delta") == 2 + TAIL_FRAMES  # frames 0..1+TAIL
    assert kinds[-1] == "response.done"
    assert tail[-1]["response"]["status"] == "completed"
    assert not timeline.responses.owes


def test_text_after_an_end_of_turn_token_goes_on_in_the_same_response():
    timeline = Timeline()
    timeline.step(text="Hi")
    timeline.step(eos=True)
    timeline.step(text=" there")
    assert "response.done" not in timeline.kinds()
    assert timeline.responses.owes


def test_commit_without_turn_detection_owes_a_response_announced_when_the_model_speaks():
    timeline = Timeline(GAConfig(turn_detection=None))
    timeline.step(user="hi")
    timeline.responses.commit()
    assert timeline.responses.owes
    assert "response.created" not in timeline.kinds(timeline.idle(GAP + 2))
    opened = timeline.step(text="Hello")
    assert timeline.kinds(opened)[:2] == ["response.created", "response.output_item.added"]


def test_without_turn_detection_a_call_before_the_commit_is_sent_and_the_commit_owes_more():
    """Push-to-talk: a call the model makes while it still hears the question is not held
    back for the commit; it is a response of its own, and the commit owes the answer."""
    timeline = Timeline(GAConfig(turn_detection=None))
    timeline.step(user="weather in")
    called = timeline.step(user=" Paris", call=True)
    assert "response.function_call_arguments.done" in timeline.kinds(called)
    assert timeline.kinds(called)[-1] == "response.done"
    committed = timeline.responses.commit()
    assert "input_audio_buffer.committed" in [e["type"] for e in committed]
    assert timeline.responses.owes
    opened = timeline.step(text="Sunny")
    assert timeline.kinds(opened)[0] == "response.created"


def test_an_owed_response_ends_incomplete_at_its_bound_with_usage():
    timeline = Timeline(GAConfig(turn_detection=None, max_response_seconds=0.8))
    timeline.responses.commit()
    out = timeline.idle(20)
    kinds = timeline.kinds(out)
    assert kinds == ["response.created", "response.done"]
    done = out[-1]["response"]
    assert done["status"] == "incomplete"
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert done["output"] == [] and done["usage"]["input_tokens"] == 10
    assert not timeline.responses.owes


def test_a_model_that_keeps_talking_is_cut_at_the_bound():
    timeline = Timeline(GAConfig(max_response_seconds=0.8))
    for _ in range(20):
        timeline.step(text="la")
    kinds = timeline.kinds()
    assert kinds.count("response.done") >= 1  # and the client's next frames open the next
    first_done = next(e for e in timeline.events if e["type"] == "response.done")
    assert first_done["response"]["status"] == "incomplete"
    assert first_done["response"]["usage"]["output_token_details"]["audio_tokens"] == 10


def test_cancel_before_the_model_spoke_ends_the_requested_response():
    timeline = Timeline()
    timeline.responses.request(None)
    out = timeline.responses.cancel()
    assert [e["type"] for e in out] == ["response.done"]
    assert out[0]["response"]["status"] == "cancelled"
    assert not timeline.responses.owes


def test_the_end_of_turn_token_ends_a_cancelled_utterance():
    timeline = Timeline()
    timeline.step(text="Long")
    timeline.responses.cancel()
    assert timeline.step(text=" story") == []
    timeline.step(eos=True)
    assert timeline.kinds(timeline.step(text="Next"))[0] == "response.created"


def test_text_modality_sends_output_text_and_no_audio():
    timeline = Timeline(replace(GAConfig(), output_modalities=("text",)))
    timeline.step(text="Hi")
    timeline.idle(GAP + 1)
    kinds = timeline.kinds()
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    assert not [k for k in kinds if k.startswith("response.output_audio")]


def test_the_end_of_the_stream_ends_the_open_response():
    timeline = Timeline()
    timeline.step(text="Bye")
    out = [json.loads(serialize(m)) for m in timeline.responses.translate([Done(1)])]
    assert out[-1]["type"] == "response.done" and out[-1]["response"]["status"] == "completed"
    assert timeline.responses.ended


def test_truncating_the_speaking_item_cancels_it_and_unknown_items_are_refused():
    timeline = Timeline()
    item_id = timeline.step(text="Hi")[1]["item"]["id"]
    assert timeline.responses.truncate("item_unknown") is None
    out = timeline.responses.truncate(item_id)
    assert out[-1]["response"]["status"] == "cancelled"
    assert timeline.responses.truncate(item_id) == []  # known, no longer speaking


def test_the_servers_silence_frames_open_no_new_response_after_the_owed_one():
    timeline = Timeline(GAConfig(turn_detection=None))
    timeline.responses.commit()
    timeline.responses.server_frames = True
    timeline.step(text="Hi")
    timeline.step(eos=True)
    timeline.idle(TAIL_FRAMES + 1)
    assert timeline.kinds().count("response.done") == 1
    assert timeline.step(text="more") == [] and not timeline.responses.owes
    timeline.responses.server_frames = False  # client audio again
    assert timeline.kinds(timeline.step(text="again"))[0] == "response.created"
