"""Rules of the package's shape that hold everywhere: read from the source, not run."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_voicechat_plugin"
OWNERS = ("self", "cls")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines: functions, classes, module/local names, ``self._x`` stores."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in OWNERS:
            names.add(node.attr)
    return names


def foreign_private_access(source: str) -> list[str]:
    """``obj._name`` reads or writes (``obj`` not self/cls) and ``from m import _name``
    where the module does not define ``_name`` itself: reaching into another module."""
    tree = ast.parse(source)
    own = defined_names(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) \
                and node.attr not in own \
                and not (isinstance(node.value, ast.Name) and node.value.id in OWNERS):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"from {node.module} import {a.name}")
                      for a in node.names if _private(a.name)]
    return [f"{line}: {text}" for line, text in sorted(found)]


def test_the_checker_finds_reaches_into_other_modules():
    source = (
        "from x import _hidden\n"
        "class A:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def f(self, other, tts):\n"
        "        other._mine, self._mine\n"  # defined here: allowed
        "        tts._with_uncond(1)\n"  # defined elsewhere: a reach
        "        tts.rng._key = None\n"
    )
    found = foreign_private_access(source)
    assert found == ["1: from x import _hidden", "7: tts._with_uncond", "8: tts.rng._key"]


def test_no_module_reaches_into_another_modules_private_names():
    offenders = []
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 50
    for path in modules:
        offenders += [f"{path.relative_to(PACKAGE)}:{line}"
                      for line in foreign_private_access(path.read_text())]
    assert offenders == []


MAX_MODULE_LINES = 400  # code lines: one concept per module (mlx-lm's shape), however long


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not a comment alone, not inside a docstring."""
    tree = ast.parse(source)
    docstring_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            docstring_lines.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return sum(1 for number, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#")
               and number not in docstring_lines)


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
    source = '"""Module.\n\nMore."""\n\n# a comment\ndef f():\n    """One."""\n    return 1\n'
    assert code_lines(source) == 2


def test_no_module_is_over_400_code_lines():
    long = {str(path.relative_to(PACKAGE)): lines for path in sorted(PACKAGE.rglob("*.py"))
            if (lines := code_lines(path.read_text())) > MAX_MODULE_LINES}
    assert long == {}
