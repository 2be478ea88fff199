"""Make the hosts' own commands hand VoiceChat checkpoints to the plugin.

mlx-vlm and mlx-audio have no plugin discovery, so the plugin installs one
``.pth`` line (``mlx_voicechat_plugin-hosts.pth`` in site-packages) that calls
:func:`install` at interpreter start. ``install`` adds one meta-path finder
that only reacts to the hosts' command modules below. When one of them runs as
``__main__`` (``python -m ...``) with ``--model``/``-m`` naming a
``nemotron_voicechat`` checkpoint, the plugin's command runs instead; in every
other case the host's own code runs unchanged. The hosts' servers are served
with their own conventions (:mod:`.conventions`: how they name the model,
their flag spellings and default address). Nothing is imported from the
hosts until they are imported themselves, so a host's own dependencies
(mlx-audio's server needs ``webrtcvad``) are not needed on the plugin's path.

Set ``MLX_VOICECHAT_HOST_PICKUP=0`` to turn the routing off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
from pathlib import Path
from types import CodeType
from typing import Any, Callable, NamedTuple, Sequence

from .conventions import MLX_AUDIO, MLX_VLM, HostServer, flag_value

ENV_SWITCH = "MLX_VOICECHAT_HOST_PICKUP"
# Same value as checkpoint.MODEL_TYPE; not imported from there because this module
# runs at every interpreter start and config imports MLX (a test pins them equal).
MODEL_TYPE = "nemotron_voicechat"


class HostCommand(NamedTuple):  # not a dataclass: this is imported at every interpreter start
    """What a host module run by ``python -m`` becomes for a VoiceChat checkpoint."""

    command: str  # the plugin command (from the registry in ``cli.main``)
    prog: str  # the host's program name, in usage messages
    server: HostServer | None = None  # a host server's conventions, which ``serve`` follows


HOST_COMMANDS: dict[str, HostCommand] = {
    "mlx_vlm.generate.__main__": HostCommand("generate", "python -m mlx_vlm.generate"),
    "mlx_audio.sts.generate": HostCommand("generate", "python -m mlx_audio.sts.generate"),
    "mlx_audio.stt.generate": HostCommand("transcribe", "python -m mlx_audio.stt.generate"),
    "mlx_vlm.server.__main__": HostCommand("serve", MLX_VLM.prog, MLX_VLM),
    "mlx_audio.server": HostCommand("serve", MLX_AUDIO.prog, MLX_AUDIO),
}
# The host server modules and their conventions (how they name the model, their flags).
HOST_SERVERS: dict[str, HostServer] = {
    name: entry.server for name, entry in HOST_COMMANDS.items() if entry.server is not None}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def model_argument(argv: Sequence[str]) -> str | None:
    """The value of ``--model``/``-m`` in ``argv``, if any."""
    return flag_value(argv, ("--model", "-m"))


def is_voicechat_checkpoint(model: str) -> bool:
    """True for a local directory, or an already-cached hub repo, of this model type.

    Never touches the network: an uncached hub id is left to the host.
    """
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # not a repo id, or no hub client
            return False
        if not isinstance(cached, str):
            return False
        config = Path(cached)
    try:
        return json.loads(config.read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


def run_plugin_command(command: str, prog: str, argv: Sequence[str],
                       host: HostServer | None = None) -> int:
    """The plugin's ``command`` (from the one registry in ``cli.main``) under the host's name.

    ``host``: the host server whose conventions ``serve`` follows.
    """
    from ..cli.main import run_command

    return run_command(command, argv, prog=prog, tolerate_unknown=True, host=host)


_ORIGINAL_CODE: dict[str, CodeType] = {}


def run_host_module(name: str, namespace: dict[str, Any]) -> None:
    """Body of a routed host module: the plugin for VoiceChat, else the host."""
    if namespace.get("__name__") == "__main__" and enabled():
        argv = sys.argv[1:]
        entry = HOST_COMMANDS[name]
        host = entry.server
        model = host.model(argv) if host else model_argument(argv)
        if model and is_voicechat_checkpoint(model):
            if host is not None:
                argv = host.translate(argv)
            raise SystemExit(run_plugin_command(entry.command, entry.prog, argv, host=host))
    exec(_ORIGINAL_CODE[name], namespace)


class _RoutingLoader(importlib.abc.Loader):
    """Wraps a host module's loader; its code first asks :func:`run_host_module`."""

    def __init__(self, name: str, original: Any):
        self.name = name
        self.original = original

    def __getattr__(self, attr: str) -> Any:  # get_filename, get_source, is_package, ...
        return getattr(self.original, attr)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return None

    def get_code(self, fullname: str) -> CodeType:
        _ORIGINAL_CODE[fullname] = self.original.get_code(fullname)
        stub = (
            "from mlx_voicechat_plugin.hosts.pickup import run_host_module as _vc_route\n"
            f"_vc_route({fullname!r}, globals())\n"
        )
        return compile(stub, self.original.get_filename(fullname), "exec")

    def exec_module(self, module: Any) -> None:
        exec(self.get_code(module.__name__), module.__dict__)


class _HostFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname not in HOST_COMMANDS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
            return spec
        spec.loader = _RoutingLoader(fullname, spec.loader)
        return spec


def install() -> None:
    """Register the finder once (called from the ``.pth`` line)."""
    if not enabled():
        return
    if not any(isinstance(f, _HostFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _HostFinder())


PTH_NAME = "mlx_voicechat_plugin-hosts.pth"
PTH_LINE = (
    "import os; os.environ.get('MLX_VOICECHAT_HOST_PICKUP', '1') in ('0', 'false', 'no', 'off') "
    "or __import__('mlx_voicechat_plugin.hosts.pickup').hosts.pickup.install()\n"
)


def install_pth(site_dir: str | None = None, write: Callable[[Path, str], None] | None = None) -> Path:
    """Write the ``.pth`` line into ``site_dir`` (default: this interpreter's purelib)."""
    import sysconfig

    target = Path(site_dir or sysconfig.get_paths()["purelib"]) / PTH_NAME
    (write or (lambda p, s: p.write_text(s)))(target, PTH_LINE)
    return target
