"""``rlite.api`` is exactly the documented surface: the list under "The public API" in
``docs/plugins.md`` is the source of truth, and ``rlite.api.__all__`` must equal it, both ways.

A name added to the module but not to the docs (or the other way round) fails here, as does a name
the module imports without listing it, or one listed that does not resolve. And ``rlite.api`` holds
interfaces and kits, never a plugin's implementation: no name it gives is defined in ``rlite.plugins``, nor
loaded from there on first use (a lazy attribute escapes the layering test, which reads import statements).
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import rlite.api as api

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "plugins.md"
HEADING = "## The public API: `rlite.api`"


def documented_names(text: str) -> list[str]:
    """The backticked names of the bullet lines under the heading (the notes in brackets are prose)."""
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("- **"):
            listed = line.split("): ", 1)[1] if "): " in line else line.split(":", 1)[1]
            names += re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", listed)
    return names


def test_rlite_api_all_is_exactly_the_documented_list() -> None:
    documented = documented_names(DOC.read_text())
    assert len(documented) == len(set(documented)), "a name is documented twice"
    assert len(api.__all__) == len(set(api.__all__)), "a name is listed twice in rlite.api.__all__"
    assert sorted(set(api.__all__) - set(documented)) == [], "in rlite.api.__all__ but not in docs/plugins.md"
    assert sorted(set(documented) - set(api.__all__)) == [], "in docs/plugins.md but not in rlite.api.__all__"


def test_every_listed_name_resolves_and_nothing_public_is_unlisted() -> None:
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    helpers = {"annotations", "importlib", "Any", "TYPE_CHECKING"}
    public = {name for name in vars(api) if not name.startswith("_")} - helpers
    assert sorted(public - set(api.__all__)) == []


def test_the_parser_reads_what_the_docs_list() -> None:
    text = f"{HEADING}\n\nProse with `a_name` in it.\n\n- **Group** (note with `other`): `One`, `two_2`\n- **More**: `Three`\n\n## Next\n- **X**: `Four`\n"
    assert documented_names(text) == ["One", "two_2", "Three"]


def plugin_implementations(module) -> list[str]:
    """The names ``module`` gives (``__all__``) that a plugin defines, and the plugin modules its lazy table
    (``_LAZY``) loads from."""
    found = [f"{name} (from {module._LAZY[name]})" for name in module.__all__
             if module._LAZY.get(name, "").startswith("rlite.plugins")]  # fmt: skip
    for name in module.__all__:
        defined_in = getattr(getattr(module, name), "__module__", None) or ""
        if defined_in.startswith("rlite.plugins"):
            found.append(f"{name} (defined in {defined_in})")
    return sorted(set(found))


def test_rlite_api_exports_no_implementation_of_a_plugin() -> None:
    assert plugin_implementations(api) == []


def test_an_exported_plugin_implementation_is_found() -> None:
    from rlite.plugins.fsdp2 import make_fsdp2

    planted = types.SimpleNamespace(__all__=["hookimpl", "make_fsdp2", "FSDP2Backend"], hookimpl=api.hookimpl,
                                    make_fsdp2=make_fsdp2, FSDP2Backend=object,
                                    _LAZY={"FSDP2Backend": "rlite.plugins.fsdp2.backend"})  # fmt: skip
    assert plugin_implementations(planted) == [
        "FSDP2Backend (from rlite.plugins.fsdp2.backend)", "make_fsdp2 (defined in rlite.plugins.fsdp2)",
    ]
