"""How client values are quoted back in errors and logs: briefly.

A client may send a megabyte where a name belongs; every message that quotes
a client value quotes at most :data:`BRIEF_CHARS` characters of its ``repr``.
"""

from __future__ import annotations

from typing import Any

BRIEF_CHARS = 40


def brief(value: Any, limit: int = BRIEF_CHARS) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
