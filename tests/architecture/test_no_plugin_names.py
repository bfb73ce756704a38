"""No plugin name compared in the core (AST, no run): the core reads what an implementation declares
(its registration's metadata, ``docs/plugins.md``'s capabilities table), never which one it is.

The core is ``trainer/`` less the built-in plugin packages: the modules of ``DEFAULT_PLUGINS`` and of this
distribution's ``rlite`` entry points, wherever they live (today all under ``plugins/``, rlite's engines
and backends each a package there; a plugin package is exempt as a whole once it is registered). In it, a
finding is

* a comparison (``==``, ``!=``, ``in``, ``not in``, a ``match`` case) of a config choice's name with a string:
  ``cfg.rollout.engine.name == "..."``, ``values["parallelism.backend"] in ("...", ...)``, ``case["backend"]``
  (any string but ``none``, an optional kind's off switch, which is a config value and no plugin);
* a comparison of a name-like value (``name``, ``engine``, ``backend_name``, ...) with a registered name,
  directly or through a module-level tuple, list or set of strings;
* a call given a choice's config key and a registered name (``equals("parallelism.backend", "...")``: a
  comparison built as a rule);
* a table of plugins by name: a dict literal keyed by two registered names of one kind, or one keyed by a
  registered name and looked up (``[...]``, ``.get``) by a choice's name.

Registered names are those of every registry with the built-ins and this distribution's entry points, less
the values of the core's own vocabulary that a plugin happens to share (a draft named ``ngram`` runs the
``ngram`` method of ``DraftSpec``). Each finding names the file and line. The checker also runs on planted
violations, so that one which finds nothing cannot pass.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

from rlite.config.choices import CHOICE_KEYS, REGISTRY_KINDS
from rlite.engines.base import DRAFT_METHODS
from rlite.plugin_manager import (
    DEFAULT_PLUGINS,
    ENTRY_POINT_GROUP,
    build_plugin_manager,
    load_entry_point_plugins,
)

ROOT = Path(__file__).resolve().parents[2]
OFF = "none"
CORE_VOCABULARY = set(DRAFT_METHODS)
CHOICE_WORDS = {key.rsplit(".", 1)[-1] for key in (k.key for k in REGISTRY_KINDS.values())} | set(REGISTRY_KINDS)
"""The last part of every choice's config key (``engine``, ``backend``, ``workflow``, ...) and the kinds."""
CHOICE_KEYS_ALL = {k.key for k in REGISTRY_KINDS.values()} | set(CHOICE_KEYS)
COMPARISONS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def builtin_entry_points() -> list[importlib.metadata.EntryPoint]:
    return [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            if ep.dist is not None and ep.dist.name == "rlite"]  # fmt: skip


def registered_names() -> dict[str, set[str]]:
    """Kind -> the names registered by the built-ins and this distribution's entry points."""
    pm = build_plugin_manager(autoload=False)
    load_entry_point_plugins(pm, only=[ep.name for ep in builtin_entry_points()])
    return {kind: set(pm.registry(kind).names()) - CORE_VOCABULARY for kind in REGISTRY_KINDS}


def builtin_plugin_paths() -> set[Path]:
    """The built-in plugins' files and package folders, relative to the repository."""
    paths = set()
    for module in [*DEFAULT_PLUGINS, *(ep.module for ep in builtin_entry_points())]:
        origin = Path(importlib.util.find_spec(module).origin).resolve()
        paths.add((origin.parent if origin.name == "__init__.py" else origin).relative_to(ROOT))
    return paths


def reads_choice_name(node: ast.AST) -> str | None:
    """``sure`` for an expression that is a config choice's name, ``name-like`` for one that may be, else None."""
    if isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Attribute) \
            and node.value.attr in CHOICE_WORDS:  # fmt: skip
        return "sure"
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        key = node.slice.value
        if key in CHOICE_KEYS_ALL or key in CHOICE_WORDS:
            return "sure"
    word = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    if word is not None and (word in CHOICE_WORDS or word == "name" or word.endswith("_name")):
        return "name-like"
    return None


def strings(node: ast.AST, constants: dict[str, list[str]]) -> list[str] | None:
    """The strings a literal (or a module-level constant of literals) holds, or None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):  # fmt: skip
        return [e.value for e in node.elts]
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    return None


def module_constants(tree: ast.Module) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Module-level names bound to literal collections of strings, and to dict literals (their string keys)."""
    collections, tables = {}, {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                       if isinstance(t, ast.Name)]  # fmt: skip
            held = strings(node.value, {}) if not isinstance(node.value, ast.Constant) else None
            keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)] \
                if isinstance(node.value, ast.Dict) else None  # fmt: skip
            for target in targets:
                if held is not None:
                    collections[target] = held
                if keys is not None:
                    tables[target] = keys
    return collections, tables


def compared(subject: ast.AST, values: list[str] | None, names: set[str]) -> list[str]:
    """The strings of ``values`` that make comparing them with ``subject`` a finding."""
    how = reads_choice_name(subject)
    if values is None or how is None:
        return []
    if how == "sure":
        return [v for v in values if v != OFF]
    return [v for v in values if v in names]


def looked_up(node: ast.AST) -> tuple[str, ast.AST] | None:
    """``(table, key)`` of ``TABLE[key]`` or ``TABLE.get(key, ...)`` with a module-level ``TABLE``."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        return node.value.id, node.slice
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and isinstance(node.func.value, ast.Name) and node.args:  # fmt: skip
        return node.func.value.id, node.args[0]
    return None


def findings(tree: ast.Module, by_kind: dict[str, set[str]]) -> list[tuple[int, str]]:
    names = set().union(*by_kind.values())
    collections, tables = module_constants(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands, operands[1:]):
                if isinstance(op, COMPARISONS):
                    hits = (compared(left, strings(right, collections), names)
                            + compared(right, strings(left, collections), names))  # fmt: skip
                    found += [(node.lineno, f"compares {ast.unparse(node)!r} with the plugin name {hit!r}")
                              for hit in hits]  # fmt: skip
        elif isinstance(node, ast.Match):
            for case in node.cases:
                values = [p.value.value for p in ast.walk(case.pattern)
                          if isinstance(p, ast.MatchValue) and isinstance(p.value, ast.Constant)
                          and isinstance(p.value.value, str)]  # fmt: skip
                found += [(case.pattern.lineno, f"matches {ast.unparse(node.subject)!r} against the plugin name {hit!r}")
                          for hit in compared(node.subject, values, names)]  # fmt: skip
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            for kind, registered in by_kind.items():
                if len(keys & registered) >= 2:
                    found.append((node.lineno, f"a table of {kind}s keyed by the plugin names "
                                               f"{sorted(keys & registered)}"))  # fmt: skip
        elif isinstance(node, ast.Call):
            given = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if set(given) & CHOICE_KEYS_ALL:
                found += [(node.lineno, f"builds a comparison {ast.unparse(node)!r} with the plugin name {name!r}")
                          for name in given if name in names]  # fmt: skip
        lookup = looked_up(node)
        if lookup is not None and lookup[0] in tables and reads_choice_name(lookup[1]) == "sure":
            keyed = sorted(set(tables[lookup[0]]) & names)
            if keyed:
                found.append((node.lineno, f"looks up {ast.unparse(node)!r} in a table keyed by the plugin names {keyed}"))
    return sorted(set(found))


def violations(root: Path, names: set[str], exempt: set[Path]) -> list[str]:
    found = []
    for path in sorted((root / "trainer").rglob("*.py")):
        relative = path.relative_to(root)
        if any(relative == e or e in relative.parents for e in exempt):
            continue
        for line, what in findings(ast.parse(path.read_text(), str(path)), names):
            found.append(f"{relative}:{line}: {what}; read the implementation's registered metadata instead")
    return found


@pytest.fixture(scope="module")
def names() -> dict[str, set[str]]:
    return registered_names()


def test_the_core_compares_no_plugin_name(names) -> None:
    assert {"transformers", "sglang"} <= names["rollout_engine"] and {"fsdp2", "megatron"} <= names["training_backend"]
    assert violations(ROOT, names, builtin_plugin_paths()) == []


def test_the_builtin_plugins_are_exempt_wherever_they_live() -> None:
    exempt = builtin_plugin_paths()
    assert {Path("plugins/transformers"), Path("plugins/sglang"), Path("plugins/fsdp2"), Path("plugins/megatron")} <= exempt
    assert not any(Path("trainer") in p.parents for p in exempt)  # today: none inside the core


PLANTED = {  # source -> (the line of the finding, what it names)
    'def f(cfg):\n    return cfg.rollout.engine.name == "transformers"\n': (2, "'transformers'"),
    'def f(cfg):\n    if cfg.parallelism.backend.name != "my_backend":\n        pass\n': (2, "'my_backend'"),
    'def f(values):\n    return values["parallelism.backend"] in ("megatron", "none")\n': (2, "'megatron'"),
    'MEGATRON = equals("parallelism.backend", "megatron")\n': (1, "'megatron'"),
    'def f(case):\n    return case["backend"] == "megatron"\n': (2, "'megatron'"),
    'def f(name):\n    return name == "sglang"\n': (2, "'sglang'"),
    'MEGATRONS = ("megatron",)\n\n\ndef f(backend_name):\n    return backend_name in MEGATRONS\n': (5, "'megatron'"),
    'MEMORY = {"transformers": 1, "sglang": 2}\n': (1, "'sglang', 'transformers'"),
    'HELD = {"transformers": 1}\n\n\ndef f(cfg):\n    return HELD.get(cfg.rollout.engine.name, 0)\n': (5, "'transformers'"),
    'def f(cfg):\n    match cfg.rollout.workflow.name:\n        case "single_turn":\n            return 1\n': (3, "'single_turn'"),
}
ALLOWED = (
    'def f(cfg):\n    return cfg.rollout.draft.name == "none"\n',  # the off switch of an optional kind
    'def f(spec):\n    return spec.method == "ngram"\n',  # the core's own vocabulary
    'def f(cfg):\n    return cfg.rollout.mode == "async"\n',  # a setting, no choice
    'def f(name):\n    return name == "inner"\n',  # a name-like value, no plugin's name
    'ENGINE = "transformers"  # a default is no comparison\n',
    'STATE = {"python": 1, "torch": 2}  # one name that a reward function happens to have\n',
)


@pytest.mark.parametrize("source", sorted(PLANTED))
def test_a_planted_comparison_is_found_naming_file_and_line(tmp_path, names, source) -> None:
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "planted.py").write_text(source)
    (found,) = violations(tmp_path, {**names, "training_backend": names["training_backend"] | {"my_backend"}}, set())
    line, named = PLANTED[source]
    assert found.startswith(f"trainer/planted.py:{line}: ") and named in found, found


def test_allowed_comparisons_and_exempt_plugin_packages_are_not_findings(tmp_path, names) -> None:
    (tmp_path / "trainer" / "engines" / "mine").mkdir(parents=True)
    for index, source in enumerate(ALLOWED):
        (tmp_path / "trainer" / f"allowed_{index}.py").write_text(source)
    violation = next(iter(PLANTED))
    (tmp_path / "trainer" / "engines" / "mine" / "__init__.py").write_text(violation)
    assert violations(tmp_path, names, {Path("trainer/engines/mine")}) == []
    assert len(violations(tmp_path, names, set())) == 1  # the same package, not registered as a plugin
