"""A named choice's options: its YAML ``args`` built into the config dataclass its plugin registered.

One path for the config loader (which checks them when the config loads) and for the run builder and
the tools (which hand them to the implementation), so what a plugin receives is exactly what was checked:

* the args are merged onto the dataclass by omegaconf (unknown keys and wrong types fail naming the full
  key, ``rollout.engine.args.sampling.bogus``), and every ``__post_init__`` runs, a nested dataclass's
  included (a failure names the nested key);
* a field holding another dataclass arrives as an instance of it, not as a dict;
* a *nested choice* -- a field declared ``field(default="transformers", metadata={"choice_of":
  "rollout_engine"})`` with its options in the sibling field ``<name>_args`` (a wrapper's inner engine) -- is
  checked against that kind's registry, and ``<name>_args`` arrives as the inner implementation's own config
  instance, built the same way (recursively; ``None`` for an implementation that takes no options).

The config keeps the options as plain data (``Choice.args``, what ``config.yaml`` holds):
:func:`options_as_args` turns a built instance back into it.

This module never imports the plugin manager: the registries are passed in (anything with ``.get(name)``
returning an entry with ``name``, ``config_cls`` and, for errors, ``config_key`` on the registry).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from rlite.config.schema import ConfigError, UnknownChoiceError

CHOICE_OF = "choice_of"
"""The field metadata key that makes a field a nested choice: ``metadata={"choice_of": kind}``."""


def nested_choices(config_cls: type) -> list[tuple[str, str, str]]:
    """``(name field, args field, registry kind)`` of every nested choice ``config_cls`` declares."""
    return [(f.name, f"{f.name}_args", f.metadata[CHOICE_OF]) for f in dataclasses.fields(config_cls)
            if CHOICE_OF in f.metadata]  # fmt: skip


def build_options(entry: Any, args: Mapping[str, Any] | None, *, kind: str, key: str,
                  registries: Mapping[str, Any] | None) -> Any:
    """The config instance of registry ``entry`` (``entry.config_cls``) from ``args``, validated; ``None``
    for an implementation that registered no config class (any args are then refused).

    ``kind`` is the entry's registry kind (``rollout_engine``), ``key`` where the options sit in the config
    (``rollout.engine.args``): every error names the key under it. ``registries`` (kind -> registry) resolve
    nested choices; without them (``None``) a nested choice's options stay the mapping they were given.
    """
    args = dict(args or {})
    if entry.config_cls is None:
        if args:
            raise ConfigError(f"{key}: {kind} {entry.name!r} takes no options, got {sorted(args)}")
        return None
    choices = nested_choices(entry.config_cls)
    # the inner choices' options are built by their own config classes (below), so they stay plain data here
    inner_args = {args_name: args.pop(args_name) for _, args_name, _ in choices if args_name in args}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(entry.config_cls), args)
        options = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{key}.{explain_omegaconf_error(exc)}") from None
    except (ValueError, TypeError) as exc:  # a __post_init__ check (ConfigError included): which class said it
        raise ConfigError(f"{_failing_key(entry.config_cls, args, key)}: {exc}") from None
    for name, args_name, inner_kind in choices:
        inner_name = getattr(options, name)
        if registries is None:  # nothing to build the inner options with: as given
            setattr(options, args_name, inner_args.get(args_name, getattr(options, args_name, None)))
            continue
        if inner_kind not in registries:
            raise ConfigError(f"{key}.{name}: {inner_kind!r} is no registry kind (field metadata choice_of)")
        try:
            inner = registries[inner_kind].get(inner_name)
        except UnknownChoiceError as exc:
            raise ConfigError(str(exc).replace(registries[inner_kind].config_key, f"{key}.{name}", 1)) from None
        given = inner_args.get(args_name, getattr(options, args_name, None))
        if given is not None and not isinstance(given, Mapping) and not dataclasses.is_dataclass(given):
            raise ConfigError(f"{key}.{args_name}: the options of {inner_name!r} must be a mapping, got {given!r}")
        if dataclasses.is_dataclass(given):
            given = dataclasses.asdict(given)
        setattr(options, args_name,
                build_options(inner, given, kind=inner_kind, key=f"{key}.{args_name}", registries=registries))
    return options


def options_as_args(options: Any, config_cls: type | None) -> dict[str, Any]:
    """A built config instance as the plain ``args`` the config keeps (a nested choice's options as a mapping,
    ``{}`` where its implementation takes none)."""
    if options is None or config_cls is None:
        return {}
    args = dataclasses.asdict(options)
    for _, args_name, _ in nested_choices(config_cls):
        inner = getattr(options, args_name)
        args[args_name] = options_as_args(inner, type(inner)) if dataclasses.is_dataclass(inner) else dict(inner or {})
    return args


def _failing_key(config_cls: type, args: Mapping[str, Any], key: str) -> str:
    """The key of the innermost nested dataclass whose own ``__post_init__`` refuses ``args`` (``key`` when
    it is ``config_cls``'s own): omegaconf builds them all in one call, which hides which one raised."""
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # noqa: BLE001  (an annotation that does not resolve: the error stays the class's)
        return key
    for option in dataclasses.fields(config_cls):
        inner_cls = hints.get(option.name)
        if not (isinstance(inner_cls, type) and dataclasses.is_dataclass(inner_cls)):
            continue
        given = args.get(option.name) or {}
        try:
            OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(inner_cls), given))
        except (ValueError, TypeError):
            return _failing_key(inner_cls, given, f"{key}.{option.name}")
        except OmegaConfBaseException:
            continue
    return key


def explain_omegaconf_error(exc: OmegaConfBaseException) -> str:
    """omegaconf's error as one line naming its key (relative to the merged node): an unknown key lists the
    valid ones and the closest, a missing one says how to set it."""
    key = getattr(exc, "full_key", None) or "?"
    msg = str(exc).split("\n")[0]
    if isinstance(exc, MissingMandatoryValue):
        return f"{key}: missing value; set it in the YAML file or with {key}=..."
    obj_type = getattr(exc, "object_type", None)
    if "not in" in msg and obj_type is not None and dataclasses.is_dataclass(obj_type):
        valid = [f.name for f in dataclasses.fields(obj_type)]
        bad = key.split(".")[-1]
        text = f"{key}: unknown key {bad!r}. Valid keys here: {', '.join(valid)}."
        close = difflib.get_close_matches(bad, valid, n=1)
        return text + (f" Did you mean {close[0]!r}?" if close else "")
    return f"{key}: {msg}"
