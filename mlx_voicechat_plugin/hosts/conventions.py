"""What a user of each host's own server expects when it serves a VoiceChat checkpoint.

``python -m mlx_vlm.server`` and ``python -m mlx_audio.server`` hand a
``nemotron_voicechat`` checkpoint to ``mlx-voicechat serve`` (see
:mod:`.pickup`). A :class:`HostServer` says how that host names the model,
which of its flags mean one of ours under another spelling, and its default
bind address, which ``serve`` then uses instead of its own. Flags of the
host that ``serve`` lacks are named one per line at start-up and ignored.
The API key variable (``MLX_VLM_SERVER_API_KEY``) is honoured by the
application itself (:mod:`..server.app`), whichever command started it.

Pure Python with no imports from the hosts: :mod:`.pickup` reads this at
interpreter start (tests pin the defaults to the hosts' own).
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple, Sequence


def flag_value(argv: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value of the first of ``flags`` in ``argv`` (``--flag V`` or ``--flag=V``)."""
    for index, arg in enumerate(argv):
        name, has_value, value = arg.partition("=")
        if name in flags:
            if has_value:
                return value
            if index + 1 < len(argv):
                return argv[index + 1]
    return None


class HostServer(NamedTuple):  # not a dataclass: this is imported at every interpreter start
    name: str  # the host, as its users call it
    prog: str  # its command
    host: str  # its default bind host
    port: int  # its default port
    model_flags: tuple[str, ...] = ("--model", "-m")  # flags naming the model to serve
    model_env: str | None = None  # a variable naming it when no flag does
    renames: tuple[tuple[str, str], ...] = ()  # (host flag, serve's flag)
    no_ops: tuple[str, ...] = ()  # valueless host flags that ask for what serve does anyway

    def model(self, argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> str | None:
        """The model ``argv`` (else the host's variable) names, if any."""
        named = flag_value(argv, self.model_flags)
        if named is not None or self.model_env is None:
            return named
        return environ.get(self.model_env) or None

    def translate(self, argv: Sequence[str],
                  environ: Mapping[str, str] = os.environ) -> list[str]:
        """``argv`` in ``serve``'s spelling: renamed flags, no-ops dropped, the model named."""
        out: list[str] = []
        for arg in argv:
            name, has_value, value = arg.partition("=")
            if name in self.no_ops and not has_value:
                continue
            name = dict(self.renames).get(name, name)
            out.append(f"{name}={value}" if has_value else name)
        if "--model" not in (a.partition("=")[0] for a in out):
            model = self.model(argv, environ)
            if model:
                out[:0] = ["--model", model]
        return out


MLX_VLM = HostServer(
    name="mlx-vlm", prog="python -m mlx_vlm.server", host="0.0.0.0", port=8080,
    renames=(("--max-num-seqs", "--max-sessions"),))

MLX_AUDIO = HostServer(
    name="mlx-audio", prog="python -m mlx_audio.server", host="localhost", port=8000,
    model_flags=("--realtime-model", "--model"), model_env="MLX_AUDIO_REALTIME_MODEL",
    renames=(("--realtime-model", "--model"),), no_ops=("--realtime",))
