"""Realtime WebSocket server for Nemotron VoiceChat (``mlx-voicechat serve``).

``protocol`` holds the wire messages, ``engine`` the one thread that runs all
MLX work, ``app`` the FastAPI application and ``limits`` the server's bounds.
"""

from __future__ import annotations

from .limits import ServerLimits

__all__ = ["ServerLimits", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
