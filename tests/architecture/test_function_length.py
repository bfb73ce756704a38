"""No function in rlite's code (``trainer/``, ``plugins/``) is over :data:`LIMIT` lines, except the CLI's argument
parser: a longer one does several things, and each of them should be a function named for what it does
(STYLE.md, "The loop").

A function's length is counted in the syntax tree, from its first decorator (or its ``def``) to its last line,
docstring, comments and blank lines included: what a reader scrolls through. A nested function counts in its
parent's length and on its own. The checker is also run on a planted violation, so that one that finds nothing
cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 80

ALLOWED = {
    "cli.py::build_parser": "the CLI's argument parser: one flat table of subcommands and their options",
}
"""``<file name>::<qualified name>`` -> why it may be longer."""

BEING_SPLIT = {
    "engine.py::SGLangEngine.__init__": "the SGLang engine, moving into its plugin package (issue 43, item 3)",
    "process.py::ProcessEngine.__init__": "the spawned transformers engine, moving into its plugin package (issue 43, item 3)",
    "payloads.py::sync_weights": "SGLang's weight payloads, moving into its plugin package (issue 43, item 3)",
}
"""Functions over the limit in code that another change is moving now; each entry must still name a function over
the limit (so the list shrinks as they are split: :func:`test_the_pending_splits_are_still_pending`)."""


def long_functions(folder: Path) -> list[tuple[str, str, int]]:
    """``(path relative to the folder's parent, "<file name>::<qualified name>", lines)`` of every function in the
    ``*.py`` files under ``folder`` longer than :data:`LIMIT` lines."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for name, lines in function_lengths(ast.parse(path.read_text()), path.name):
            if lines > LIMIT:
                found.append((str(path.relative_to(folder.parent)), name, lines))
    return found


def function_lengths(tree: ast.AST, file_name: str) -> list[tuple[str, int]]:
    """``("<file name>::<qualified name>", lines)`` of every function (methods and nested functions too)."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                out.append((f"{file_name}::{prefix}{child.name}", child.end_lineno - start + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def rlite_long_functions() -> list[tuple[str, str, int]]:
    return long_functions(ROOT / "trainer") + long_functions(ROOT / "plugins")


def test_no_function_is_over_the_limit():
    over = [f"{path}: {name} ({lines} lines)" for path, name, lines in rlite_long_functions()
            if name not in ALLOWED and name not in BEING_SPLIT]
    assert over == [], (f"functions over {LIMIT} lines: split each into functions named for what they do: "
                        + "; ".join(over))


def test_the_pending_splits_are_still_pending():
    """An entry of :data:`BEING_SPLIT` whose function is now within the limit (or gone) is removed from it."""
    over = {name for _, name, _ in rlite_long_functions()}
    done = sorted(set(BEING_SPLIT) - over)
    assert done == [], f"within {LIMIT} lines now (or gone): remove from BEING_SPLIT: {done}"


def test_the_checker_finds_a_planted_long_function(tmp_path):
    package = tmp_path / "trainer"
    (package / "stages").mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT - 2))
    (package / "stages" / "planted.py").write_text(
        "import functools\n\n\n"
        f"def at_the_limit():\n    \"\"\"{LIMIT} lines.\"\"\"\n{body}\n\n\n"
        "class Holder:\n"
        "    @functools.cache\n"  # the decorator's line counts: LIMIT + 1
        f"    def method(self):\n        \"\"\"Over.\"\"\"\n" + body.replace("    ", "        ") + "\n\n"
        "    def outer(self):\n"
        "        def inner():\n"  # a nested function over the limit is found on its own, and in its parent
        "            \"\"\"Over.\"\"\"\n" + body.replace("    ", "            ") + "\n            return 0\n"
        "        return inner\n"
    )  # fmt: skip
    found = {name: lines for _, name, lines in long_functions(package)}
    assert found == {"planted.py::Holder.method": LIMIT + 1, "planted.py::Holder.outer.inner": LIMIT + 1,
                     "planted.py::Holder.outer": LIMIT + 3}
    assert [path for path, _, _ in long_functions(package)] == ["trainer/stages/planted.py"] * 3


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_an_allowed_function_is_there(name):
    """An allowance for a function that is gone (or renamed) is a stale entry, not a pass."""
    names = {found for folder in ("trainer", "plugins") for path in sorted((ROOT / folder).rglob("*.py"))
             for found, _ in function_lengths(ast.parse(path.read_text()), path.name)}
    assert name in names
