"""``mlx-voicechat``: the plugin's command line."""

from __future__ import annotations

import sys
from typing import Sequence

COMMANDS = {
    "generate": "one offline voice-chat turn",
    "serve": "the realtime WebSocket server",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: mlx-voicechat {" + ",".join(COMMANDS) + "} ...")
        for name, text in COMMANDS.items():
            print(f"  {name:10s} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "generate":
        from .generate import main as generate_main

        return generate_main(rest)
    if command == "serve":
        from .serve import main as serve_main

        return serve_main(rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
