"""The samples of ``docs/plugins.md`` that show rlite's own output, regenerated from the code.

A sample sits between two markers in the Markdown::

    <!-- generated: NAME (python -m rlite.tools.docs_samples --write) -->
    ```text
    ...
    ```
    <!-- end generated -->

and :data:`SAMPLES` says how each is made: ``rlite-plugins`` is the table ``rlite plugins`` prints for rlite's
built-in plugins, its own entry points (megatron) and the example package of ``examples/rlite-example-plugin``
as if pip had installed it; ``config-errors`` are the one-line errors ``rlite config`` prints for a misspelled
option, a misspelled option of a wrapper's inner engine and an unknown name. Each is made with only those
plugins, whatever else is installed, so the text depends on the code alone.

``python -m rlite.tools.docs_samples`` (run in the repository) says which samples are stale and exits 1 if any is;
``--write`` rewrites them in place. ``tests/docs/test_docs_samples.py`` runs it against the committed file.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import importlib.metadata
import io
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlite.hookspecs import hookimpl

BLOCK = re.compile(r"(?P<head><!-- generated: (?P<name>[\w-]+) [^\n]*-->\n)(?P<body>.*?)(?P<tail><!-- end generated -->)",
                   re.S)  # fmt: skip
WIDTH = 118
"""Columns of the rendered tables: what fits the docs' code blocks."""
EXAMPLE = Path("examples") / "rlite-example-plugin"
"""The example third-party package, relative to the repository."""


def _pyproject_field(text: str, pattern: str) -> str:
    found = re.search(pattern, text, re.M)
    if found is None:
        raise ValueError(f"{EXAMPLE / 'pyproject.toml'}: no match for {pattern!r}")
    return found.group(1)


@contextlib.contextmanager
def _example_importable(repo: Path) -> Iterator[tuple[str, str, str, str]]:
    """``(entry-point name, module, distribution, version)`` of the example package, importable meanwhile."""
    root = repo / EXAMPLE
    text = (root / "pyproject.toml").read_text()
    name = _pyproject_field(text, r'^name\s*=\s*"([^"]+)"')
    version = _pyproject_field(text, r'^version\s*=\s*"([^"]+)"')
    entry, module = re.search(r'\[project\.entry-points\.rlite\]\s*\n(\w+)\s*=\s*"([\w.]+)"', text).groups()
    sys.path.insert(0, str(root))
    try:
        yield entry, module, name, version
    finally:
        sys.path.remove(str(root))
        for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
            del sys.modules[loaded]


def sample_manager(repo: Path):
    """A plugin manager of rlite's built-ins, the entry points of rlite's own distribution and the example
    package (named and versioned as its ``pyproject.toml`` says), and nothing else installed."""
    from rlite.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(autoload=False)
    own = importlib.metadata.distribution("rlite")
    for ep in sorted((ep for ep in own.entry_points if ep.group == "rlite"), key=lambda ep: ep.name):
        pm.register(ep.load(), name=ep.name)
        pm.origins[ep.name] = (own.metadata["Name"], own.version)
    with _example_importable(repo) as (entry, module, distribution, version):
        pm.register(importlib.import_module(module), name=entry)
        pm.origins[entry] = (distribution, version)
    pm.check_pending()
    return pm


def plugins_sample(repo: Path) -> str:
    """``rlite plugins`` for :func:`sample_manager`'s plugins."""
    from rich.console import Console

    from rlite.tools.cli import describe_plugins, print_plugin_tables

    out = io.StringIO()
    console = Console(file=out, width=WIDTH, color_system=None, force_terminal=False, highlight=False)
    print_plugin_tables(describe_plugins(sample_manager(repo)), console=console)
    return "$ rlite plugins\n" + "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"


CONFIG_ERRORS = (
    "algorithm.advantage=median_baseline algorithm.advantage.args.scal=0.5",
    "rollout.engine=counting rollout.engine.args.inner_args.dtyp=float32",
    "algorithm.advantage=grpo_plus",
)
"""The overrides of :func:`config_errors_sample` (on ``configs/quickstart.yaml``), one error each."""


@dataclass
class _CountingConfig:
    inner: str = field(default="transformers", metadata={"choice_of": "rollout_engine"})
    """The wrapped engine."""
    inner_args: Any = None
    """Its options."""


class _CountingPlugin:
    """The wrapper engine ``docs/plugins.md`` builds (``counting``, nested options), for the nested-key error."""

    @hookimpl
    def register_rollout_engines(self, register) -> None:
        register("counting", lambda *args: None, _CountingConfig)


def config_errors_sample(repo: Path) -> str:
    """What ``rlite config configs/quickstart.yaml <override>`` prints for each of :data:`CONFIG_ERRORS`."""
    from rlite.config import ConfigError, load_config

    pm = sample_manager(repo)
    pm.register(_CountingPlugin(), name="counting")
    lines = []
    for overrides in CONFIG_ERRORS:
        try:
            load_config(repo / "configs" / "quickstart.yaml", overrides.split(), pm=pm)
        except ConfigError as exc:
            lines += [f"$ rlite config configs/quickstart.yaml {overrides}", f"rlite config: error: {exc}"]
        else:
            raise AssertionError(f"config-errors sample: {overrides!r} loads without an error")
    return "\n".join(lines) + "\n"


SAMPLES: dict[str, Callable[[Path], str]] = {
    "rlite-plugins": plugins_sample,
    "config-errors": config_errors_sample,
}


def regenerate(text: str, repo: Path) -> str:
    """``text`` (a Markdown file) with every generated sample made again from the code."""
    seen = []

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in SAMPLES:
            raise KeyError(f"unknown generated sample {name!r}; known: {', '.join(SAMPLES)}")
        seen.append(name)
        return f"{match.group('head')}```text\n{SAMPLES[name](repo)}```\n{match.group('tail')}"

    out = BLOCK.sub(replace, text)
    missing = sorted(set(SAMPLES) - set(seen))
    if missing:
        raise KeyError(f"no generated block for {', '.join(missing)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlite.tools.docs_samples", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale samples in place")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the repository (default: the working folder)")
    parser.add_argument("--docs", type=Path, default=Path("docs") / "plugins.md", help="the file, relative to --repo")
    args = parser.parse_args(argv)
    path = args.repo / args.docs
    text = path.read_text()
    fresh = regenerate(text, args.repo)
    if fresh == text:
        print(f"{path}: every sample is current")
        return 0
    if args.write:
        path.write_text(fresh)
        print(f"{path}: samples rewritten")
        return 0
    sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), fresh.splitlines(True), str(path), "regenerated"))
    print(f"{path}: stale samples; run python -m rlite.tools.docs_samples --write", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
