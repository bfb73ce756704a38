"""No dead engine methods: every public method of a class under ``rlite/engines`` or of rlite's own engine
plugins (``plugins/transformers``, ``plugins/sglang``) is used somewhere.

A method counts as used when its name appears as an attribute (``x.name``) or a string (``getattr``,
a pipe message) anywhere in rlite, its plugins, tests or benchmarks, outside its own definition. An
engine method nobody calls (an untested fallback such as a weight path that was never wired into the
loop) reads as a feature that works; it is either wired and tested, or removed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("trainer", "plugins", "tests", "benchmarks")
ENGINES = ("trainer/engines", "plugins/transformers", "plugins/sglang")
CALLED_BY_TRANSFORMERS = {("RowCache", "get_seq_length")}
"""Methods of a duck-typed transformers cache that transformers' models call (``past_key_values.get_seq_length()``
in ``Qwen2Model.forward``), never rlite."""


def public_methods(path: Path) -> list[tuple[str, str, int]]:
    """``(class, method, line)`` of every public method defined in ``path``, for the classes that are
    rlite's own (a class extending a third-party one, such as a transformers cache layer, implements
    methods its base's users call)."""
    tree = ast.parse(path.read_text())
    local = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and all(ast.unparse(base) in local for base in node.bases):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    found.append((node.name, item.name, item.lineno))
    return found


def uses(root: Path) -> dict[str, set[tuple[Path, int]]]:
    """Where each name is used as an attribute or a string constant. A use inside a function of the
    same name does not count: a method that only hands on to another object's method of its name
    (``def f(self): return self.backend.f()``) uses it only if someone uses the first."""
    seen: dict[str, set[tuple[Path, int]]] = {}

    def visit(node: ast.AST, path: Path, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            name = None
            if isinstance(child, ast.Attribute):
                name = child.attr
            elif isinstance(child, ast.Constant) and isinstance(child.value, str) and child.value.isidentifier():
                name = child.value
            if name is not None and name != function:
                seen.setdefault(name, set()).add((path, child.lineno))
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            visit(child, path, inner)

    for folder in SOURCES:
        for path in (root / folder).rglob("*.py"):
            visit(ast.parse(path.read_text()), path, None)
    return seen


def dead_methods(root: Path) -> list[str]:
    seen = uses(root)
    dead = []
    for path in sorted(p for folder in ENGINES for p in (root / folder).rglob("*.py")):
        for cls, name, line in public_methods(path):
            if (cls, name) not in CALLED_BY_TRANSFORMERS and not seen.get(name, set()) - {(path, line)}:
                dead.append(f"{path.relative_to(root)}:{line} {cls}.{name}")
    return dead


def test_every_engine_method_is_used():
    assert dead_methods(ROOT) == []


def test_a_planted_dead_method_is_found(tmp_path):
    for folder in SOURCES:
        (tmp_path / folder).mkdir()
    engines = tmp_path / "trainer" / "engines"
    engines.mkdir()
    (engines / "engine.py").write_text(
        "class Engine:\n    def generate(self):\n        return self.update_weights_from_somewhere\n"
        "    def update_weights_from_nowhere(self):\n        return self.backend.update_weights_from_nowhere()\n"
    )
    (tmp_path / "tests" / "test_engine.py").write_text("def test(engine):\n    engine.generate()\n")
    assert dead_methods(tmp_path) == ["trainer/engines/engine.py:4 Engine.update_weights_from_nowhere"]
