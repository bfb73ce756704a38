"""The house rules of rlite's layout, checked on the source (AST, no imports):

* the core (``trainer/`` = ``rlite``) never imports the built-in plugins (``rlite.plugins``);
* no core module imports a heavy optional dependency at module level (transformers, peft, datasets,
  SGLang, megatron-core, liger, ...): they load inside the functions that need them;
* built-in plugins import from rlite only through the public API (``rlite.api``) and their own
  package, like a third-party plugin;
* the config (schema and loader) never imports the plugin manager: registries are passed in;
* the loop and its stages talk to backends and engines through their contracts, never importing an
  implementation (``rlite.backends.*``, ``rlite.engines.transformers``, ``rlite.engines.sglang``).

Each rule is also run on a planted violation, so a checker that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("transformers", "peft", "datasets", "sglang", "megatron", "liger_kernel", "trl", "tensorboard", "wandb",
         "math_verify", "matplotlib")
IMPLEMENTATIONS = ("rlite.backends", "rlite.engines.transformers", "rlite.engines.sglang")


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
            if under(name, "rlite.loop", "rlite.stages", "rlite.run") and under(imported, *IMPLEMENTATIONS):
                found.append(f"{where}: {name} imports the implementation {imported} (use the contract)")
    return found


def test_the_tree_keeps_the_rules() -> None:
    assert violations(ROOT) == []


PLANTED = {
    "trainer/loop.py": "from rlite.plugins.kl import kl_k3\n",
    "trainer/metrics.py": "import transformers\n\n\ndef f():\n    import peft  # inside a function: allowed\n",
    "plugins/kl.py": "from rlite.mismatch import fraction\nfrom rlite.api import hookimpl  # allowed\n",
    "trainer/config/loader.py": "def f():\n    from rlite.plugin_manager import get_plugin_manager\n",
    "trainer/stages/sync.py": "from rlite.backends.fsdp2.weights import iter_full_tensors\n",
    "trainer/engines/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sglang  # allowed\n",
}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_planted_violation_is_found(tmp_path, planted) -> None:
    target = tmp_path / planted
    target.parent.mkdir(parents=True)
    target.write_text(PLANTED[planted])
    (tmp_path / "plugins").mkdir(exist_ok=True)
    found = violations(tmp_path)
    if planted == "trainer/engines/base.py":
        assert found == []
    else:
        assert len(found) == 1, found
        assert str(Path(planted)) in found[0]
