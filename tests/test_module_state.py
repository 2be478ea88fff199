"""The networks and the runtime keep no state in their modules.

State lives in the object whose life it shares (a batch, a session, the
model, the pool); a memo of a pure function may be a ``functools`` cache. So
no module of ``models/`` or ``runtime/`` (nor the instruments) has a
``global`` statement, or a module-level container that its functions change
at run time: read from the source with ``ast``, so a new one fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mlx_voicechat_plugin

PACKAGE = Path(mlx_voicechat_plugin.__file__).parent
FOLDERS = ("models", "runtime", "instruments")

# Made at import: a literal or a call of one of these is a container.
CONTAINER_CALLS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "deque",
                   "Counter", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}
CONTAINER_NODES = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
# Methods that change a container in place.
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
            "setdefault", "add", "discard", "appendleft", "popleft", "sort", "reverse",
            "__setitem__", "__delitem__"}


def _modules() -> list[Path]:
    return sorted(p for folder in FOLDERS if (PACKAGE / folder).is_dir()
                  for p in (PACKAGE / folder).rglob("*.py"))


def _is_container(value: ast.AST | None) -> bool:
    if isinstance(value, CONTAINER_NODES):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        return name in CONTAINER_CALLS
    return False


def _module_containers(tree: ast.Module) -> set[str]:
    """Names the module binds, at its top level, to a container."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _is_container(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and _is_container(node.value) \
                and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _base_name(node: ast.AST) -> str | None:
    """``NAME`` of ``NAME[...]`` (any depth of subscripts) or of ``NAME`` itself."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _changed_in_functions(tree: ast.Module, names: set[str]) -> set[str]:
    """Of ``names``, those a function or method of the module changes in place."""
    changed = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                             ast.Lambda))]
    for function in functions:
        for node in ast.walk(function):
            targets: list[ast.AST] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = [t for t in node.targets if isinstance(t, ast.Subscript)]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in MUTATORS:
                targets = [node.func.value]
            changed |= {name for t in targets if (name := _base_name(t)) in names}
    return changed


def _findings(path: Path) -> list[str]:
    return _findings_of(path.read_text(), path)


def test_the_scan_sees_the_modules():
    modules = {p.relative_to(PACKAGE).as_posix() for p in _modules()}
    assert {"models/kv_arena.py", "runtime/pool.py", "runtime/compute.py"} <= modules


@pytest.mark.parametrize("source, finding", [
    ("_SEEN = {}\ndef f(k):\n    _SEEN[k] = 1\n", "module-level _SEEN"),
    ("_ON = None\ndef f(on):\n    global _ON\n    _ON = on\n", "global _ON"),
    ("import weakref\n_REFS = weakref.WeakKeyDictionary()\nclass A:\n"
     "    def f(self, k):\n        _REFS.setdefault(k, 1)\n", "module-level _REFS"),
    ("_ROWS: list = []\ndef f():\n    _ROWS.clear()\n", "module-level _ROWS"),
])
def test_the_scan_finds_module_state(source, finding):
    found = _findings_of(source, PACKAGE / "models" / "_probe.py")
    assert any(finding in f for f in found), found


def test_constants_and_functools_caches_are_not_state():
    source = ("import functools\n_NAMES = {'a': 1}\n_KEYS = frozenset({'a'})\n"
              "@functools.lru_cache(maxsize=8)\ndef made(n):\n    return [n]\n"
              "def f():\n    local = {}\n    local['a'] = _NAMES['a']\n    return local\n")
    assert _findings_of(source, PACKAGE / "models" / "_probe.py") == []


def _findings_of(source: str, path: Path) -> list[str]:
    tree = ast.parse(source)
    where = path.relative_to(PACKAGE).as_posix()
    found = [f"{where}:{node.lineno}: global {', '.join(node.names)}"
             for node in ast.walk(tree) if isinstance(node, ast.Global)]
    found += [f"{where}: module-level {name} is changed at run time"
              for name in sorted(_changed_in_functions(tree, _module_containers(tree)))]
    return found


def test_no_module_of_the_networks_or_the_runtime_keeps_state():
    found = [f for path in _modules() for f in _findings(path)]
    assert found == [], "\n".join(found)
