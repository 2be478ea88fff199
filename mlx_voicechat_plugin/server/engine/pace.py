"""How late one session's frames ran: frames stepped, the late ones and the worst lateness.

A frame is *late* when the step that ran it took longer than one frame of
wall time (80 ms) per frame: the server fell behind the client's audio for
it. The engine counts this for the whole server (``/metrics``:
``voicechat_late_frames_total``); a :class:`FramePace` counts it for one
session, on the engine thread for one cycle (the hand-off's, :mod:`.channel`)
and summed on the session's event loop (:class:`~..session.session.Session`), so a
dialect can tell the client how its own frames went without the server's
API key (the GA dialect's ``voicechat`` extension on ``response.done``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class FramePace:
    """Frames stepped, how many ran late, and the most one ran late by (ms)."""

    frames: int = 0
    late_frames: int = 0
    max_late_ms: float = 0.0

    def step(self, frames: int, seconds: float, frame_duration: float) -> None:
        """``frames`` frames of this session ran in a step (or flush) of ``seconds``."""
        if frames <= 0:
            return
        self.frames += frames
        late = seconds / frames - frame_duration
        if late > 0:
            self.late_frames += frames
            self.max_late_ms = max(self.max_late_ms, late * 1000.0)

    def add(self, other: "FramePace") -> None:
        self.frames += other.frames
        self.late_frames += other.late_frames
        self.max_late_ms = max(self.max_late_ms, other.max_late_ms)

    def wire(self) -> dict[str, Any]:
        """The figures as a client reads them (``max_late_ms`` to 0.1 ms)."""
        return {"frames": self.frames, "late_frames": self.late_frames,
                "max_late_ms": round(self.max_late_ms, 1)}
