"""A scripted mlx-vlm client that drops its TCP connection and resumes (issue 42's tests).

:func:`converse` plays one conversation on the tiny fixture: one 80 ms frame an
append, each followed by a ping whose pong says the frame's events are in; at
``tool_at`` frames the function call is answered (before any audio past that
point, so the result enters the timeline at the same frame in every run); then
commit. With ``drop_at`` it sends a burst of frames it does not wait for,
aborts its socket (a TCP reset: no close frame, the events in flight lost)
and resumes with its ``resume_token`` and the last ``seq`` it read, resending
its audio from what ``session.resumed`` says the server holds. A silent drop
leaves the socket open and quiet (a half-open link) and resumes at once.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
from raw_client import RawClient
from server_support import FRAME, append_message
from tool_support import RESULT

BURST = 3  # frames sent unacknowledged before a drop
SKIPPED = ("session.pong", "session.resumed", "session.created", "session.updated")


def abort(client: RawClient) -> None:
    """Drop the connection as a lost link does: a reset, no close frame."""
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.sock.close()


def event(client: RawClient) -> dict:
    opcode, payload = client.read_frame()
    assert opcode == 0x1, (opcode, payload[:80])
    return json.loads(payload)


def reattach(port: int, path: str, seconds: float = 10.0, **kwargs: Any) -> RawClient:
    """Resume at ``path``, again while another resume of the session is being accepted
    (409), as a client should."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return RawClient(port, path, **kwargs)
        except AssertionError as refused:
            if b" 409 " not in refused.args[0] or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


WAIT = 10.0  # seconds a test waits for what the server does in the background


def until(condition, what: str):
    """``condition()``'s first true value, waited for (at most :data:`WAIT` seconds)."""
    deadline = time.monotonic() + WAIT
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def metric(live: Any, name: str, headers: dict | None = None) -> float:
    """One figure of ``live``'s ``/metrics``."""
    for line in httpx.get(live.http("/metrics"), headers=headers).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def resume_path(path: str, token: str, last_seq: int) -> str:
    return f"{path}?resume_token={quote(token)}&last_seq={last_seq}"


class Conversation:
    """One scripted conversation's client and everything it read."""

    def __init__(self, port: int, signal: np.ndarray, tool_at: int | None,
                 path: str = "/v1/realtime"):
        self.port, self.signal, self.tool_at, self.path = port, signal, tool_at, path
        self.events: list[dict] = []  # every event read, in order (resumed ones included)
        self.client = RawClient(port, path)
        self.token = ""
        self.answered = False
        self.resumes: list[dict] = []  # the session.resumed events
        self.superseded: tuple[int, str] | None = None  # a silent drop's close, when taken

    def read(self) -> dict:
        got = event(self.client)
        self.events.append(got)
        return got

    def until(self, kind: str) -> None:
        while self.read()["type"] != kind:
            pass

    @property
    def last_seq(self) -> int:
        return max((e["seq"] for e in self.events if "seq" in e), default=0)

    def start(self, **session: Any) -> None:
        created = self.read()
        assert created["type"] == "session.created", created
        self.token = created["session"]["resume_token"]
        self.client.send_json({"type": "session.update", "session": session})
        self.until("session.updated")

    def answer_call(self) -> None:
        (call,) = [e for e in self.events if e["type"] == "response.function_call_arguments.done"]
        self.client.send_json({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": call["call_id"], "output": RESULT}})
        self.answered = True

    def frame(self, index: int, wait: bool = True) -> None:
        self.client.send_json(append_message(self.signal[index * FRAME:(index + 1) * FRAME]))
        if wait:
            self.client.send_json({"type": "session.ping"})
            self.until("session.pong")

    def drop_and_resume(self, at: int, silent: bool = False) -> int:
        """Send frames from ``at`` unacknowledged, drop, resume: the frame to go on from.

        ``silent``: the link goes quiet instead of resetting (a half-open connection the
        server cannot see drop), and the resume comes at once: it takes the session
        over, and the server closes the old connection (1000)."""
        end = at + BURST if self.tool_at is None or at >= self.tool_at else \
            min(at + BURST, self.tool_at)
        for index in range(at, end):
            self.frame(index, wait=False)
        old, path = self.client, resume_path(self.path, self.token, self.last_seq)
        if silent:
            self.client = RawClient(self.port, path)  # never a 409: the resume takes it
            self.superseded = old.close_frame()
            old.close()
        else:
            abort(old)
            self.client = reattach(self.port, path)
        resumed = event(self.client)
        assert resumed["type"] == "session.resumed", resumed
        assert "seq" not in resumed
        self.resumes.append(resumed)
        for _ in range(resumed["replayed"]):
            self.read()
        self.client.send_json({"type": "session.ping"})  # answered after the held audio ran
        self.until("session.pong")
        held = resumed["audio_received_samples"]
        assert held % FRAME == 0 and at * FRAME <= held <= end * FRAME, (held, at, end)
        return held // FRAME

    def run(self, frames: int, drop_at: int | None = None, silent: bool = False) -> list[dict]:
        """The whole conversation; every event read (``silent``: see :meth:`drop_and_resume`)."""
        index = 0
        while index < frames:
            if index == self.tool_at and not self.answered:
                self.answer_call()
            if index == drop_at:
                drop_at = None
                index = self.drop_and_resume(index, silent)
                continue
            self.frame(index)
            index += 1
        self.client.send_json({"type": "input_audio_buffer.commit"})
        self.until("response.done")
        self.client.close()
        return self.events


def stream(events: list[dict]) -> list[dict]:
    """What a conversation said, its ids and numbers left out: every event's fields (text,
    function and transcript deltas, audio and its codes, frame indices), in order."""
    drop = ("seq", "call_id", "event_id")
    return [{k: v for k, v in e.items() if k not in drop} for e in events
            if e["type"] not in SKIPPED]


def numbered(events: list[dict]) -> list[int]:
    """The ``seq`` of every event but ``session.resumed`` (which carries none)."""
    return [e["seq"] for e in events if e["type"] != "session.resumed"]
