"""``mlx-voicechat``: the plugin's command line, and the one command registry.

The hosts' commands (``python -m mlx_vlm.generate`` / ``mlx_vlm.server`` /
``mlx_audio.server`` / ``mlx_audio.sts.generate`` / ``mlx_audio.stt.generate``, see
:mod:`..hosts.pickup`) run the same registry.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ..hosts.conventions import HostServer

# name -> (module in this package, help). Each module has the same entry point,
# ``main(argv, prog, tolerate_unknown, host)``: ``host`` is the host server a
# host's command ran it for (None from ``mlx-voicechat``); only ``serve`` has
# conventions to follow, the others take it and need nothing from it.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate", "one offline voice-chat turn"),
    "serve": ("serve", "the realtime WebSocket server"),
    "transcribe": ("transcribe", "a file's transcript (perception + RNNT only)"),
    "demo": ("demo", "build the tiny demo checkpoint and answer a synthetic question"),
    "convert": ("convert", "a checkpoint (NVIDIA's release or MLX) in a precision profile"),
    "compare": ("compare", "one question through two checkpoints: answers, ids, stage SNR"),
}


def run_command(command: str, argv: Sequence[str], prog: str | None = None,
                tolerate_unknown: bool = False, host: "HostServer | None" = None) -> int:
    """Run registered ``command`` with ``argv`` (``prog`` names it in usage messages)."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; one of {', '.join(COMMANDS)}")
    module = importlib.import_module(f"{__package__}.{COMMANDS[command][0]}")
    return module.main(list(argv), prog=prog or f"mlx-voicechat {command}",
                       tolerate_unknown=tolerate_unknown, host=host)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from .. import __version__

        print(f"mlx-voicechat {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: mlx-voicechat [--version] {" + ",".join(COMMANDS) + "} ...")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:10s} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return run_command(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
