"""docs/plugins.md is the plugin author's guide: every hook is there with its exact signature, and
its examples run."""

from __future__ import annotations

import inspect
import re
import sys
import types
from pathlib import Path

import pytest

from rlite import hookspecs
from rlite.plugin_manager import build_plugin_manager

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
HOOKS = {
    name: function
    for name, function in vars(hookspecs).items()
    if callable(function) and hasattr(function, f"{hookspecs.PROJECT_NAME}_spec")
}


def call_signature(name: str) -> str:
    """``after_rollout(step, batch)``: the hook as a plugin author writes it."""
    return f"{name}({', '.join(inspect.signature(HOOKS[name]).parameters)})"


def typed_signature(name: str) -> str:
    """``after_rollout(step: int, batch: RolloutBatch) -> None`` (annotations as written in hookspecs)."""
    signature = inspect.signature(HOOKS[name])
    params = ", ".join(f"{p.name}: {p.annotation}" for p in signature.parameters.values())
    return f"{name}({params}) -> {signature.return_annotation}"


@pytest.fixture(scope="module")
def docs() -> str:
    return DOCS.read_text()


def python_examples(text: str) -> list[str]:
    return [block for block in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "@hookimpl" in block]


def test_hook_signature_helpers() -> None:
    assert call_signature("register_advantage_estimators") == "register_advantage_estimators(register)"
    assert typed_signature("after_rollout") == "after_rollout(step: int, batch: RolloutBatch) -> None"


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_plugin_hooks_are_documented(docs: str, name: str) -> None:
    assert f"### `{call_signature(name)}`" in docs, (
        f"docs/plugins.md needs a section for {call_signature(name)}"
    )
    assert f"def {typed_signature(name)}: ..." in docs, f"docs/plugins.md must show {typed_signature(name)}"


def test_documented_hooks_exist(docs: str) -> None:
    documented = re.findall(r"^### `(\w+)\(", docs, flags=re.M)
    assert sorted(documented) == sorted(HOOKS)


def test_docs_examples_register_and_pass_check_pending(docs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    examples = python_examples(docs)
    assert len(examples) >= len(HOOKS)
    implemented = set()
    for index, source in enumerate(examples):
        module = types.ModuleType(f"docs_example_{index}")
        monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look their module up
        exec(compile(source, f"docs/plugins.md example {index}", "exec"), module.__dict__)
        pm = build_plugin_manager(autoload=False)
        pm.register(module, name=module.__name__)
        pm.check_pending()
        registered = [entry for registry in pm.registries.values() for entry in registry.entries.values()]
        implemented |= {hook.name for hook in pm.get_hookcallers(module) or []}
        for entry in registered:
            if entry.plugin == module.__name__ and entry.config_cls is not None:
                entry.config_cls()  # options need defaults: a bare name in YAML must work
    assert implemented == set(HOOKS)
