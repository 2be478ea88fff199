"""The package's modules import each other without a circle (module-level imports).

Read from the source, not by importing: each module's top-level ``import`` /
``from ... import`` statements (``TYPE_CHECKING`` blocks and imports inside
functions left out), resolved to the package's modules, with a submodule's
import counting as its packages' too (Python runs their ``__init__`` first).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_voicechat_plugin"
ROOT = PACKAGE.name


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _top_level(tree: ast.Module):
    """Import statements run when the module is imported."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                pending.extend(node.orelse)
            else:
                pending.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            pending.extend(node.body + node.orelse + node.finalbody
                           + [n for h in node.handlers for n in h.body])
        elif isinstance(node, ast.With):
            pending.extend(node.body)


def _with_packages(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & MODULES.keys()


def imports(name: str) -> set[str]:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _top_level(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        for target in targets:
            if target.startswith(ROOT):
                found |= _with_packages(target)
    found.discard(name)
    return found


def test_the_graph_is_read():
    assert "mlx_voicechat_plugin.models.model" in imports("mlx_voicechat_plugin.loader")
    assert "mlx_voicechat_plugin.server.engine" in imports("mlx_voicechat_plugin.server.app")


def test_no_module_level_import_circle():
    graph = {name: imports(name) for name in MODULES}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join(path + [target]))
            if not state.get(target):
                visit(target, path + [target])
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [node])


def test_models_do_not_import_the_runtime():
    """The runtime builds its sessions from a model, never the other way round."""
    for name, path in MODULES.items():
        if name.startswith(ROOT + ".models"):
            tree = ast.parse(path.read_text())
            modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert not any("runtime" in m for m in modules), name


def test_the_instruments_are_off_every_path_but_benches_and_tests():
    """Measurement code (kernel and sync counters, the mx.eval patch) is imported by no
    module of the package at module level: a session never loads it."""
    graph = {name: imports(name) for name in MODULES}
    instruments = set(_under(ROOT + ".instruments"))
    assert instruments
    for name in MODULES:
        if name not in instruments:
            assert not graph[name] & instruments, name


def test_a_dialect_helper_module_loads_no_web_framework():
    """``server.dialects`` names its dialects lazily: ``ga.audio`` alone needs no FastAPI."""
    import subprocess
    import sys

    code = ("import sys, mlx_voicechat_plugin.server.dialects.ga.audio; "
            "print('fastapi' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


SERVER = ROOT + ".server"


def _reach(name: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module ``name`` imports, directly or through others."""
    seen, pending = set(), [name]
    while pending:
        for target in graph[pending.pop()] - seen:
            seen.add(target)
            pending.append(target)
    return seen


def _under(package: str) -> list[str]:
    return [n for n in MODULES if n == package or n.startswith(package + ".")]


def test_the_server_layers_import_only_below_themselves():
    """Dialects know no transport, transports no dialect, and the engine package neither
    (nor the session layer or the connection that glue them)."""
    graph = {name: imports(name) for name in MODULES}
    dialects, transports = _under(SERVER + ".dialects"), _under(SERVER + ".transport")
    sessions, connection = _under(SERVER + ".session"), [SERVER + ".connection"]
    assert dialects and transports and SERVER + ".session.session" in sessions
    for name in dialects:
        assert not _reach(name, graph) & set(transports), name
    for name in transports:
        assert not _reach(name, graph) & set(dialects + sessions + connection), name
    for name in _under(SERVER + ".engine"):
        assert not _reach(name, graph) & set(dialects + transports + sessions + connection), name
    for name in sessions:
        assert not _reach(name, graph) & set(dialects + transports + connection), name
