"""The wire dialects the server speaks, one module each, and the list the app serves.

A dialect module defines a :class:`~..connection.Connection` subclass (its
greeting, error payload, parse of client frames, what it does with each
message, its :class:`~..commands.Translator` of runtime events, and its own
turn and commit rules) and ``DIALECT``, a :class:`~..connection.Dialect`
naming its WebSocket paths. Adding a dialect is one new module plus its
``DIALECT`` in :data:`DIALECTS` (or in ``create_app(..., dialects=...)``).

- :mod:`.vlm`: mlx-vlm's realtime dialect at ``/v1/realtime`` (events: :mod:`.vlm_events`).
- :mod:`.ga`: OpenAI Realtime GA at ``/openai/v1/realtime`` (:mod:`.ga_session`,
  :mod:`.ga_responses`, :mod:`.ga_audio`).
"""

from __future__ import annotations

from ..connection import Dialect
from .ga import DIALECT as GA
from .vlm import DIALECT as VLM

DIALECTS: tuple[Dialect, ...] = (VLM, GA)

__all__ = ["DIALECTS", "GA", "VLM"]
