"""The wire dialects the server speaks, one module each, and the list the app serves.

A dialect module defines a :class:`~..connection.Connection` subclass (its
greeting, error payload, parse of client frames, what it does with each
message, its translation of runtime events (run on the connection's event
loop), and its own turn and commit rules) and ``DIALECT``, a :class:`~..connection.Dialect`
naming its WebSocket paths. Adding a dialect is one new module plus its
``DIALECT`` in ``DIALECTS`` below (or in ``create_app(..., dialects=...)``).

- :mod:`.vlm`: mlx-vlm's realtime dialect at ``/v1/realtime`` (events: :mod:`.vlm_events`).
- :mod:`.ga`: OpenAI Realtime GA at ``/openai/v1/realtime`` (:mod:`.ga_session`,
  :mod:`.ga_responses`, :mod:`.ga_turns`, :mod:`.ga_items`, :mod:`.ga_audio`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DIALECTS", "GA", "VLM"]


def __getattr__(name: str) -> Any:
    """``DIALECTS`` (mlx-vlm's, then GA's), ``VLM``, ``GA``, imported when first asked for:
    importing one dialect's helper module (e.g. :mod:`.ga_audio`) loads no other."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .ga import DIALECT as GA
    from .vlm import DIALECT as VLM

    served = {"VLM": VLM, "GA": GA, "DIALECTS": (VLM, GA)}
    globals().update(served)
    return served[name]
