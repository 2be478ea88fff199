"""Realtime WebSocket server for Nemotron VoiceChat (``mlx-voicechat serve``).

A realtime conversation is three things apart, glued by a ``connection``:
a ``session`` (the engine side, the dialect's state, the clocks; it can
outlive a transport), a dialect from ``dialects`` (one module each: client
messages read, runtime events told as typed ``messages``) and a
``transport`` (a WebSocket, or in memory: frames in, messages serialized
out, its own close codes); ``wire`` holds what the dialects' wires share;
``engine`` is the one thread that runs all MLX work (its
``commands``, one ``channel`` per session where frames are cut, the
``stepping`` of the channels in batched steps, ``jobs``), ``transport``
how events travel, ``operations`` running a replica (drain, the balancer's
view, transcription requests), ``routes`` one router per concern (realtime,
transcriptions, status, models, the browser page), ``app`` the FastAPI
application that wires them and ``limits`` the server's bounds, checked once.
"""

from __future__ import annotations

from .limits import ServerLimits

__all__ = ["ServerLimits", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
