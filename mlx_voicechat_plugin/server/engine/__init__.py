"""The engine: the one thread that touches MLX, what runs on it, and its hand-over points.

On the engine thread: ``thread`` (:class:`Engine`'s cycle), ``channel`` one
session's inbox where frames are cut, ``stepping`` and ``scheduler`` the
channels run in batched pool steps, ``jobs`` long work stepped between them
(file transcriptions, prefills), ``warm_up`` the start-up traces. Crossing
from the event loop: ``commands`` (built there, run here), ``feed`` a
session's bounded input (event-loop side), ``admission`` who may open a
session (any thread), ``metrics`` what the engine counted (read at each
scrape). Nothing here speaks a dialect or knows a transport.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "load_voicechat"]


def __getattr__(name: str) -> Any:
    """``Engine`` and ``load_voicechat`` from :mod:`.thread`, imported when first asked
    for (the package's modules import each other, never the package)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import thread

    globals().update({n: getattr(thread, n) for n in __all__})
    return globals()[name]
