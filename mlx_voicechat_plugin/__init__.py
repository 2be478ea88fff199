"""Nemotron VoiceChat for the MLX serving stack (mlx-vlm, mlx-audio).

Importing the package is cheap (the host-pickup ``.pth`` hook imports it at
every interpreter start); MLX and the networks load on first use of ``load``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .config import ModelConfig
    from .loader import load

__all__ = ["ModelConfig", "load", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "load":
        from .loader import load

        return load
    if name == "ModelConfig":
        from .config import ModelConfig

        return ModelConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
