"""The wire dialects the server speaks, one module each, and the list the app serves.

A dialect module defines a :class:`~.base.Dialect` subclass: its ``name`` and
WebSocket ``paths``, its greeting and error event, its parse of client
messages, what it does with each message, its translation of runtime events
into typed messages (:mod:`..messages`, run on the event loop), and its own
turn and commit rules. One instance serves one session and holds the
dialect's state of it. Adding a dialect is one new module plus its class in
``DIALECTS`` below (or in ``create_app(..., dialects=...)``); see
docs/development.md.

- :mod:`.vlm`: mlx-vlm's realtime dialect at ``/v1/realtime`` (events: :mod:`.vlm_events`).
- :mod:`.ga`: OpenAI Realtime GA at ``/openai/v1/realtime``, a package
  (:mod:`.ga.dialect`; its session config :mod:`.ga.config`, :mod:`.ga.responses`,
  :mod:`.ga.records`, :mod:`.ga.items`, :mod:`.ga.audio`, :mod:`.ga.playback`).
- :mod:`.nvidia`: NVIDIA's VoiceChat protocol at ``/nvidia/v1/realtime``, a package
  (:mod:`.nvidia.dialect`, its client messages :mod:`.nvidia.messages`, its
  events :mod:`.nvidia.events`).
- :mod:`.live`: OpenAI's GPT-Live at ``/openai/v1/live/sessions``, a package
  (:mod:`.live.dialect`, its config :mod:`.live.config`, its output
  :mod:`.live.timeline`, its delegations :mod:`.live.delegations`).

A dialect imports no transport: it never sees a socket, a close code or JSON text.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DIALECTS", "GA", "LIVE", "NVIDIA", "NVIDIA_ROOT", "NVIDIA_ROOT_DIALECTS", "VLM"]


def __getattr__(name: str) -> Any:
    """``DIALECTS`` (mlx-vlm's, GA's, NVIDIA's, GPT-Live's), ``VLM``, ``GA``, ``NVIDIA``,
    ``LIVE``, ``NVIDIA_ROOT_DIALECTS`` (NVIDIA's at the root, then GA's and GPT-Live's),
    imported when first asked for:
    importing one dialect's helper module (e.g. :mod:`.ga.audio`) loads no other."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .ga.dialect import GADialect as GA
    from .live.dialect import LiveDialect as LIVE
    from .nvidia.dialect import NvidiaDialect as NVIDIA, NvidiaRootDialect as NVIDIA_ROOT
    from .vlm import VLMDialect as VLM

    served = {"VLM": VLM, "GA": GA, "NVIDIA": NVIDIA, "NVIDIA_ROOT": NVIDIA_ROOT, "LIVE": LIVE,
              "DIALECTS": (VLM, GA, NVIDIA, LIVE), "NVIDIA_ROOT_DIALECTS": (NVIDIA_ROOT, GA, LIVE)}
    globals().update(served)
    return served[name]
