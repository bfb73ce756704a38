"""Plugin manager: built-ins, entry-point plugins, and the registries of named choices.

Every implementation rlite ships is a plugin registered with ``pm.register``, as a third-party one is, and
imports only :mod:`rlite.api` and its own package (``tests/architecture/test_layering.py``); the core never
imports a plugin. Two paths lead to ``pm.register``, chosen by what the default config needs, not by who
wrote the plugin:

* :data:`DEFAULT_PLUGINS`: what the default config names and what needs nothing beyond rlite's own
  dependencies to register (the estimators, losses, rewards, ..., the ``transformers`` and ``sglang``
  engines, the ``fsdp2`` backend). They are registered whatever ``plugins.autoload`` /
  ``RLITE_DISABLE_PLUGIN_AUTOLOAD`` and ``plugins.enable`` / ``RLITE_PLUGINS`` say: those switches choose
  which *other* code runs, and turning them off must leave the default run working. SGLang is among them
  although its engine needs a package of its own: its registration imports nothing of SGLang and declares
  ``available``, so it costs nothing where SGLang is absent (as before the engines became packages).
* The ``rlite`` entry-point group: third-party plugins, and rlite's own ``megatron`` backend
  (``pyproject.toml``), whose options refuse to load without megatron-core and which ``plugins.enable``
  may leave out like any other entry point.

Discovery of entry-point plugins is off when the environment variable ``RLITE_DISABLE_PLUGIN_AUTOLOAD``
is set (to anything but ``0``/empty) or when ``plugins.autoload: false`` in the config;
``RLITE_PLUGINS=name1,name2`` / ``plugins.enable`` restrict it to the named entry points.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.metadata
import os
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

import rlite.hookspecs as hookspecs
from rlite.config import RunConfig, load_config
from rlite.config.capabilities import metadata_problem
from rlite.config.choices import REGISTRY_KINDS
from rlite.config.options import build_options
from rlite.config.schema import UnknownChoiceError

DEFAULT_PLUGINS: list[str] = [
    "rlite.plugins.advantages",
    "rlite.plugins.policy_losses",
    "rlite.plugins.kl",
    "rlite.plugins.corrections",
    "rlite.plugins.quantizers",
    "rlite.plugins.drafts",
    "rlite.plugins.fsdp2",
    # a registry holds the entries of the last-registered plugin first: the engines read transformers, sglang
    "rlite.plugins.sglang",
    "rlite.plugins.transformers",
    "rlite.plugins.rewards",
    "rlite.plugins.code_exec",
    "rlite.plugins.workflows",
    "rlite.plugins.loggers",
]

ENTRY_POINT_GROUP = "rlite"

class PluginError(Exception):
    """A plugin registered something invalid (duplicate name, bad config class)."""


@dataclass
class Registered:
    """One registered implementation."""

    name: str
    implementation: Any
    config_cls: type | None
    plugin: str
    metadata: dict[str, Any] = field(default_factory=dict)
    """What the implementation requires or offers, as the plugin declared it (``needs_critic=True``)."""


@dataclass
class Registry:
    """The implementations of one kind, by name."""

    kind: str
    config_key: str
    entries: dict[str, Registered] = field(default_factory=dict)
    registries: dict[str, Registry] = field(default_factory=dict, repr=False, compare=False)
    """Every registry of the same manager (this one included), by kind: where a nested choice of an
    implementation's options (``metadata={"choice_of": kind}``) is looked up."""

    def add(self, name: str, implementation: Any, config_cls: type | None, plugin: str, **metadata: Any) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {self.kind} with invalid name {name!r}")
        if name in self.entries:
            other = self.entries[name].plugin
            raise PluginError(
                f"{self.kind} {name!r} is registered twice: by plugin {other!r} and by plugin {plugin!r}; "
                "rename one of them"
            )
        if config_cls is not None and not hasattr(config_cls, "__dataclass_fields__"):
            raise PluginError(f"plugin {plugin!r}: config_cls of {self.kind} {name!r} must be a dataclass")
        problem = metadata_problem(self.kind, metadata)  # the capabilities table (rlite.config.capabilities)
        if problem is not None:
            raise PluginError(f"plugin {plugin!r}: {self.kind} {name!r}: {problem}")
        self.entries[name] = Registered(name, implementation, config_cls, plugin, metadata)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> Registered:
        if name not in self.entries:
            raise UnknownChoiceError(unknown_choice_message(self.config_key, name, self.names(), self.kind))
        return self.entries[name]

    def resolve(self, choice, key: str | None = None) -> tuple[Any, Any]:
        """The implementation a config ``Choice`` names and its options built as the config loader checked
        them (:func:`rlite.config.options.build_options`: nested dataclasses and nested choices' options
        arrive as config instances; None for an implementation without a config class). ``key``: where the
        choice sits in the config, for messages (default: this kind's key)."""
        entry = self.get(choice.name)
        options = build_options(entry, choice.args, kind=self.kind, key=f"{key or self.config_key}.args",
                                registries=self.registries)
        return entry.implementation, options


def unknown_choice_message(key: str, value: Any, choices: list[str], what: str = "value") -> str:
    msg = f"{key}: unknown {what} {value!r}. Valid choices: {', '.join(choices) if choices else '(none)'}."
    close = difflib.get_close_matches(str(value), choices, n=1)
    if close:
        msg += f" Did you mean {close[0]!r}?"
    return msg


@dataclass
class PluginInfo:
    """What ``rlite plugins`` shows about one plugin."""

    name: str
    distribution: str
    version: str
    hooks: list[str]
    error: str | None = None


class RlitePluginManager(pluggy.PluginManager):
    """A pluggy manager that also keeps the registries and a record of where plugins came from."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.origins: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        self.failed: list[PluginInfo] = []
        self._registries: dict[str, Registry] | None = None

    # -- registries ---------------------------------------------------------------------------
    @property
    def registries(self) -> dict[str, Registry]:
        if self._registries is None:
            self._registries = self._collect_registries()
        return self._registries

    def registry(self, kind: str) -> Registry:
        return self.registries[kind]

    def _collect_registries(self) -> dict[str, Registry]:
        registries = {}
        for kind, choice_kind in REGISTRY_KINDS.items():
            registry = Registry(kind, choice_kind.key)
            caller = getattr(self.hook, choice_kind.hook)
            # Call each implementation separately so every entry knows which plugin made it.
            for impl in reversed(caller.get_hookimpls()):
                plugin_name = impl.plugin_name

                def register(name, implementation, config_cls=None, _plugin=plugin_name, _reg=registry, **metadata):
                    _reg.add(name, implementation, config_cls, _plugin, **metadata)

                impl.function(register=register)
            registries[kind] = registry
        for registry in registries.values():
            registry.registries = registries
        return registries

    def invalidate(self) -> None:
        """Forget the collected registries (call after registering or removing a plugin)."""
        self._registries = None

    def register(self, plugin, name=None):  # noqa: D401 - pluggy signature
        result = super().register(plugin, name)
        self.invalidate()
        return result

    def unregister(self, plugin=None, name=None):
        result = super().unregister(plugin, name)
        self.invalidate()
        return result

    def check_pending(self) -> None:
        """pluggy's typo check, with the message naming the plugin as registered (and its distribution)."""
        try:
            super().check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.get_name(exc.plugin) or repr(exc.plugin)
            dist, version = self.origins.get(name, ("(registered at run time)", ""))
            where = f"{dist} {version}".strip()
            raise pluggy.PluginValidationError(
                exc.plugin,
                f"plugin {name!r} ({where}): {str(exc).split(' in plugin ')[0]}; "
                "hook names are listed in rlite.hookspecs",
            ) from None

    # -- introspection ------------------------------------------------------------------------
    def plugin_infos(self) -> list[PluginInfo]:
        infos = []
        for name, plugin in self.list_name_plugin():
            if plugin is None:
                continue
            hooks = sorted(h.name for h in self.get_hookcallers(plugin) or [])
            dist, version = self.origins.get(name, ("(registered at run time)", ""))
            infos.append(PluginInfo(name, dist, version, hooks))
        return infos + list(self.failed)


def _autoload_enabled(config_autoload: bool | None) -> bool:
    env = os.environ.get("RLITE_DISABLE_PLUGIN_AUTOLOAD", "")
    if env not in ("", "0"):
        return False
    return True if config_autoload is None else bool(config_autoload)


def load_entry_point_plugins(pm: RlitePluginManager, only: list[str] | None = None) -> None:
    """Register every plugin of the ``rlite`` entry-point group; record failures, never raise."""
    env_only = os.environ.get("RLITE_PLUGINS")
    if env_only is not None:
        only = [n.strip() for n in env_only.split(",") if n.strip()]
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if only is not None and ep.name not in only:
            continue
        dist = ep.dist.name if ep.dist is not None else "(unknown distribution)"
        version = ep.dist.version if ep.dist is not None else ""
        if pm.has_plugin(ep.name):
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken plugin must not take the trainer down
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            pm.failed.append(
                PluginInfo(ep.name, dist, version, [], error=f"failed to load {ep.value!r}: {detail}")
            )
            continue
        pm.origins[ep.name] = (dist, version)


def build_plugin_manager(autoload: bool | None = None, only: list[str] | None = None) -> RlitePluginManager:
    """Build the manager: built-ins, then entry-point plugins (unless disabled), then check_pending."""
    pm = RlitePluginManager()
    from rlite.version import __version__

    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
        pm.origins[module_name] = ("rlite (built-in)", __version__)
    if _autoload_enabled(autoload):
        load_entry_point_plugins(pm, only)
    pm.check_pending()
    return pm


_DEFAULT_PM: RlitePluginManager | None = None


def get_plugin_manager() -> RlitePluginManager:
    """The process-wide manager with default discovery (built lazily, then cached)."""
    global _DEFAULT_PM
    if _DEFAULT_PM is None:
        _DEFAULT_PM = build_plugin_manager()
    return _DEFAULT_PM


def set_plugin_manager(pm: RlitePluginManager | None) -> None:
    """Replace the process-wide manager (used by the CLI after reading ``plugins.*`` config, and tests)."""
    global _DEFAULT_PM
    _DEFAULT_PM = pm


def resolve_choice(registry: Registry, choice) -> tuple[Any, Any]:
    """The implementation named by a config ``Choice`` and its options (:meth:`Registry.resolve`)."""
    return registry.resolve(choice)


@contextlib.contextmanager
def plugin_manager_in_use(pm: RlitePluginManager) -> Iterator[RlitePluginManager]:
    """Make ``pm`` the process-wide manager while a run is built, so that :func:`registered` called from
    a plugin's factory sees the run's plugins (``plugins.enable`` included)."""
    global _DEFAULT_PM
    previous, _DEFAULT_PM = _DEFAULT_PM, pm
    try:
        yield pm
    finally:
        _DEFAULT_PM = previous


def registered(kind: str, name: str) -> Registered:
    """The entry (``implementation``, ``config_cls``, ``plugin``, ``metadata``) registered as ``name`` among the ``kind`` choices (``"rollout_engine"``,
    ``"training_backend"``, ``"advantage_estimator"``, ... : the keys of ``REGISTRY_KINDS``), from the
    process-wide manager: the one the running rlite built (respecting ``plugins.enable``). A wrapper
    plugin composes a built-in through it instead of importing rlite's private modules. An unknown name
    raises and lists the registered ones."""
    if kind not in REGISTRY_KINDS:
        raise KeyError(unknown_choice_message("kind", kind, sorted(REGISTRY_KINDS), "registry kind"))
    return get_plugin_manager().registry(kind).get(name)


def load_run_config(path: str, overrides: Sequence[str]) -> tuple[RunConfig, RlitePluginManager]:
    """Read the ``plugins`` section, build the plugin manager it asks for, then validate against it.

    Named choices can only be checked once the third-party plugins are known, and which plugins load
    is itself configured, so the config is read twice: first without the registry check.
    """
    discovery = load_config(path, overrides, pm=False, check=False).plugins
    pm = build_manager(autoload=discovery.autoload, only=discovery.enable)
    cfg = load_config(path, overrides, pm=pm)
    return cfg, pm


def build_manager(autoload: bool | None = None, only: list[str] | None = None) -> RlitePluginManager:
    """``build_plugin_manager`` with a hook-name typo turned into a one-line error."""
    try:
        return build_plugin_manager(autoload=autoload, only=only)
    except pluggy.PluginValidationError as exc:
        raise PluginError("; ".join(str(exc).splitlines())) from None
