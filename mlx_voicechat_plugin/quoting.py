"""How values from outside are quoted back in errors and logs: briefly.

A caller of the runtime or a client of the server may send a megabyte where a
name belongs: every error that quotes such a value quotes at most
:data:`BRIEF_CHARS` characters of its ``repr`` (:func:`brief`), and the server
cuts each error message it sends (:func:`~.server.wire.bounded`) by the same
rule (:func:`cut`). Below every layer: the runtime's checks and the server's
dialects both quote with it.
"""

from __future__ import annotations

from typing import Any

BRIEF_CHARS = 40


def cut(text: str, limit: int) -> str:
    """``text``, or its first characters and ``...`` within ``limit`` characters."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def brief(value: Any, limit: int = BRIEF_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    return cut(repr(value), limit)
