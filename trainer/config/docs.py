"""``rlite config --doc``: the resolved config as YAML with each field's docstring as a comment above it.

A field's docstring is the string literal right under it in its dataclass (the convention of
:mod:`rlite.config.schema` and of the config classes plugins register); Python keeps no such string at
run time, so it is read from the class's source with :mod:`ast`. The options of a named choice
(``args``) are documented from the config class its plugin registered. The output is the same YAML as
``rlite config`` prints, comments aside.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
from typing import Any

import yaml

from rlite.config.choices import CHOICE_KEYS
from rlite.config.schema import Choice, RunConfig


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` of a dataclass, read from its source (empty when there is none)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's docstring wins
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):  # fmt: skip
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _scalar(value: Any) -> str:
    """``value`` as inline YAML."""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, sort_keys=False).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def _comment(doc: str | None, indent: str) -> list[str]:
    if not doc:
        return []
    return [f"{indent}# {line}" for line in textwrap.wrap(doc, width=max(100 - len(indent), 40))]


class _Writer:
    def __init__(self, pm) -> None:
        self.pm = pm
        self.lines: list[str] = []

    def dataclass(self, obj: Any, indent: str, path: str) -> None:
        docs = field_docs(type(obj))
        for field in dataclasses.fields(obj):
            key = f"{path}.{field.name}" if path else field.name
            self.lines += _comment(docs.get(field.name), indent)
            self.value(field.name, getattr(obj, field.name), indent, key)

    def value(self, name: str, value: Any, indent: str, key: str) -> None:
        if isinstance(value, Choice):
            self.lines.append(f"{indent}{name}:")
            self.choice(value, indent + "  ", key, first="")
        elif isinstance(value, list) and value and all(isinstance(v, Choice) for v in value):
            self.lines.append(f"{indent}{name}:")
            for choice in value:
                self.choice(choice, indent + "  ", key, first="- ")
        elif dataclasses.is_dataclass(value):
            self.lines.append(f"{indent}{name}:")
            self.dataclass(value, indent + "  ", key)
        else:
            self.lines.append(f"{indent}{name}: {_scalar(value)}")

    def choice(self, choice: Choice, indent: str, key: str, first: str) -> None:
        """``name`` and ``args`` of a named choice, each option with its plugin's docstring."""
        self.lines.append(f"{indent}{first}name: {_scalar(choice.name)}")
        inner = indent + " " * len(first)
        config_cls = self._config_cls(key, choice.name)
        docs = field_docs(config_cls) if config_cls is not None else {}
        if not choice.args:
            self.lines.append(f"{inner}args: {{}}")
            return
        self.lines.append(f"{inner}args:")
        for arg, value in choice.args.items():
            self.lines += _comment(docs.get(arg), inner + "  ")
            self.lines.append(f"{inner}  {arg}: {_scalar(value)}")

    def _config_cls(self, key: str, name: str) -> type | None:
        kind = CHOICE_KEYS.get(key)
        if self.pm is None or not self.pm or kind is None:
            return None
        try:
            return self.pm.registry(kind).get(name).config_cls
        except Exception:  # an unknown name (``none``) has no options to document
            return None


def documented_yaml(cfg: RunConfig, pm=None) -> str:
    """The config as YAML, every field preceded by its docstring as ``# ...`` comments; ``pm`` (a plugin
    manager) documents the options of named choices from their plugins' config classes."""
    writer = _Writer(pm)
    writer.dataclass(cfg, "", "")
    return "\n".join(writer.lines) + "\n"
