"""The house rules of rlite's layout, checked on the source (AST, no imports):

* the core (``trainer/`` = ``rlite``) never imports the built-in plugins (``rlite.plugins``), the
  engines and training backends rlite ships among them: the loop, its stages and the run reach those
  only through their contracts;
* no core module imports a heavy optional dependency at module level (transformers, peft, datasets,
  SGLang, megatron-core, liger, ...): they load inside the functions that need them;
* plugins import rlite.api and their own package: a built-in plugin imports from rlite only through the
  public API (``rlite.api``) and its own package (``rlite.plugins.fsdp2.*`` for ``plugins/fsdp2/``), like
  a third-party plugin, with no exception for rlite's own engines and backends;
* the config (schema and loader) never imports the plugin manager: registries are passed in;
* the batch type (``rlite.rollout``) imports no engine module (``rlite.engines.*``): engines build on
  it, not the other way round;
* no import cycle among rlite's modules, and none among its packages (``rlite.stages``, ``rlite.run``,
  ``rlite.engines``, ... each taken whole, a plugin package likewise): a package that imports one
  which imports it back is half of one layer whatever its modules do. Every import counts: at module level, inside a function and
  under ``if TYPE_CHECKING:``. A late import hides a cycle from Python, not from the reader (the two
  modules still cannot be understood or changed one without the other), and a type-only import is still
  a dependency; a cycle is broken by moving what both need into a module below them.
  ``from package import name`` counts as an import of ``package.name`` when that is a module.
  (In the sentences above, "module" is any rlite module; the package rule reads the same imports.)

Each rule is also run on a planted violation, so a checker that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("transformers", "peft", "datasets", "sglang", "megatron", "liger_kernel", "trl", "tensorboard", "wandb",
         "math_verify", "matplotlib")
BATCH_TYPE = "rlite.rollout"


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    top = {"trainer": ["rlite"], "plugins": ["rlite", "plugins"]}[parts[0]]
    parts = top + parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import; ``if TYPE_CHECKING:`` blocks are skipped."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.module, top))
            nested = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, nested)

    visit(tree, True)
    return found


def every_import(tree: ast.AST, *, names: bool = False) -> list[str]:
    """Every module an import names, wherever it stands (``if TYPE_CHECKING:`` and functions included).
    ``names``: ``from package import name`` also gives ``package.name``, which :func:`import_graph`
    keeps only where it is a module."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            if names:
                found.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """rlite module -> the rlite modules it imports (a name that is no module resolves to the nearest
    enclosing one: ``rlite.engines.base.Completion`` -> ``rlite.engines.base``)."""
    paths = {module_name(path, root): path
             for path in sorted([*(root / "trainer").rglob("*.py"), *(root / "plugins").rglob("*.py")])}  # fmt: skip
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = set()
        for imported in every_import(ast.parse(path.read_text(), str(path)), names=True):
            parts = imported.split(".")
            while parts and ".".join(parts) not in paths:
                parts.pop()
            target = ".".join(parts)
            if target and target != name and not name.startswith(target + "."):  # a package's own __init__ is no edge back
                targets.add(target)
        graph[name] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def package_of(module: str) -> str:
    """The unit of the package rule: ``rlite.X`` for the core, ``rlite.plugins.X`` for a plugin."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[1:2] == ["plugins"] and len(parts) > 2 else parts[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph with each module replaced by its package (:func:`package_of`)."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = packages.setdefault(package_of(module), set())
        edges.update(package_of(t) for t in targets if package_of(t) != package_of(module))
    return packages


def crossings(graph: dict[str, set[str]], packages: list[str]) -> dict[tuple[str, str], list[str]]:
    """For each pair of ``packages`` with an import between them, the modules that make it."""
    found: dict[tuple[str, str], list[str]] = {}
    for module in sorted(m for m in graph if package_of(m) in packages):
        for target in sorted({package_of(t) for t in graph[module]} & set(packages) - {package_of(module)}):
            found.setdefault((package_of(module), target), []).append(module)
    return found


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted([*(root / "trainer").rglob("*.py"), *(root / "plugins").rglob("*.py")]):
        name = module_name(path, root)
        where = path.relative_to(root)
        for imported, top in imports(ast.parse(path.read_text(), str(path))):
            if under(name, "rlite.plugins"):
                own_package = ".".join(name.split(".")[:3])  # a plugin package may import itself
                if under(imported, "rlite") and imported != "rlite.api" and not under(imported, own_package):
                    found.append(f"{where}: a plugin imports {imported} (use rlite.api)")
                continue
            if under(imported, "rlite.plugins"):
                found.append(f"{where}: the core imports the plugin {imported}")
            if top and under(imported, *HEAVY):
                found.append(f"{where}: heavy import of {imported} at module level")
            if under(name, "rlite.config") and under(imported, "rlite.plugin_manager"):
                found.append(f"{where}: the config imports the plugin manager")
        if name == BATCH_TYPE:
            found.extend(f"{where}: the batch type imports the engine module {imported}"
                         for imported in every_import(ast.parse(path.read_text(), str(path)))
                         if under(imported, "rlite.engines"))  # fmt: skip
    graph = import_graph(root)
    for cycle in import_cycles(graph):
        edges = "; ".join(f"{a} -> {', '.join(sorted(graph[a] & set(cycle)))}" for a in cycle)
        found.append(f"import cycle among {', '.join(cycle)}: {edges}")
    explained = {frozenset(package_of(m) for m in cycle) for cycle in import_cycles(graph)}
    for cycle in import_cycles(package_graph(graph)):
        if frozenset(cycle) in explained:  # the module cycle above, already reported
            continue
        edges = "; ".join(f"{a} -> {b} ({', '.join(modules)})" for (a, b), modules in crossings(graph, cycle).items())
        found.append(f"package import cycle among {', '.join(cycle)}: {edges}")
    return found


def test_the_tree_keeps_the_rules() -> None:
    assert violations(ROOT) == []


PLANTED = {
    "trainer/run/loop.py": "from rlite.plugins.kl import kl_k3\n",
    "trainer/metrics.py": "import transformers\n\n\ndef f():\n    import peft  # inside a function: allowed\n",
    "plugins/kl.py": "from rlite.algorithms.mismatch import fraction\nfrom rlite.api import hookimpl  # allowed\n",
    "trainer/config/loader.py": "def f():\n    from rlite.plugin_manager import get_plugin_manager\n",
    "trainer/stages/sync.py": "from rlite.plugins.fsdp2.weights import iter_full_tensors\n",
    "trainer/engines/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sglang  # allowed\n",
    "plugins/fsdp2/backend.py": "from rlite.api import hookimpl\nfrom rlite.plugins.fsdp2.sharding import load_sharded  # allowed: its own package\n",
    "plugins/transformers/engine.py": "from rlite.engines.sampling import filter_logits  # rlite's inside, not rlite.api\n",
    "plugins/sglang/__init__.py": "def f():\n    from rlite.plugins.transformers.engine import TransformersEngine  # another plugin's inside\n",
    "trainer/rollout.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlite.engines.base import Completion\n",
}
ALLOWED = ("trainer/engines/base.py", "plugins/fsdp2/backend.py")


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_planted_violation_is_found(tmp_path, planted) -> None:
    target = tmp_path / planted
    target.parent.mkdir(parents=True)
    target.write_text(PLANTED[planted])
    (tmp_path / "plugins").mkdir(exist_ok=True)
    found = violations(tmp_path)
    if planted in ALLOWED:
        assert found == []
    else:
        assert len(found) == 1, found
        assert str(Path(planted)) in found[0]


CYCLE = {
    "trainer/alpha.py": "import torch\n\n\ndef f():\n    from rlite.beta import g  # a late import still counts\n",
    "trainer/beta.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlite.gamma import h  # so does a type-only one\n",
    "trainer/gamma.py": "from rlite import alpha\n",
    "trainer/delta.py": "from rlite.alpha import f  # depends on the cycle, is not in it\n",
    "trainer/pkg/__init__.py": "from rlite.pkg.inner import x  # a package importing its own module: no cycle\n",
    "trainer/pkg/inner.py": "import torch\n",
}


def test_a_planted_import_cycle_is_found(tmp_path) -> None:
    for relative, text in CYCLE.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    (tmp_path / "plugins").mkdir()
    found = violations(tmp_path)
    assert len(found) == 1, found
    assert found[0].startswith("import cycle among rlite.alpha, rlite.beta, rlite.gamma: "), found
    (tmp_path / "trainer/gamma.py").write_text("import torch\n")
    assert violations(tmp_path) == []


PACKAGE_CYCLE = {
    "trainer/low/__init__.py": "",
    "trainer/low/a.py": "from rlite.high.b import g  # low -> high\n",
    "trainer/high/__init__.py": "",
    "trainer/high/b.py": "import torch\n",
    "trainer/high/c.py": "from rlite.low.d import h  # high -> low: no module cycle, a package one\n",
    "trainer/low/d.py": "import torch\n",
}


def test_a_planted_package_cycle_is_found(tmp_path) -> None:
    for relative, text in PACKAGE_CYCLE.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    (tmp_path / "plugins").mkdir()
    found = violations(tmp_path)
    assert len(found) == 1, found
    assert found[0].startswith("package import cycle among rlite.high, rlite.low: "), found
    assert "rlite.high.c" in found[0] and "rlite.low.a" in found[0], found
    (tmp_path / "trainer/high/c.py").write_text("import torch\n")
    assert violations(tmp_path) == []
