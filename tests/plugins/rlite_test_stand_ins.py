"""Test-only stand-ins for the named choices that the default config selects.

While a built-in plugin module is still being written, the names the default ``RunConfig`` picks
(``grpo``, ``k3``, ``jsonl``, ...) may not be registered yet, and every config would fail to load.
This plugin registers exactly the names that no real built-in registers, so it does nothing once
the built-ins are complete. Implementations raise if called: config and CLI tests only need the
names. Used as an extra built-in (the ``stand_ins`` fixture) or as an entry point in a fake
distribution (subprocess tests).
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from rlite import hookimpl
from rlite.plugin_manager import DEFAULT_PLUGINS, RlitePluginManager

DEFAULT_CONFIG_NAMES: dict[str, list[str]] = {
    "advantage_estimator": ["grpo"],
    "policy_loss": ["ppo_clip"],
    "kl_estimator": ["k3"],
    "reward_function": ["exact_match"],
    "rollout_engine": ["transformers"],
    "training_backend": ["fsdp2"],
    "logger": ["jsonl", "tensorboard"],
}


def not_implemented(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("a test stand-in was called; the real built-in plugin is not written yet")


@cache
def missing_names() -> dict[str, tuple[str, ...]]:
    """Names of the default config that the real built-in plugins do not register."""
    pm = RlitePluginManager()
    for module_name in DEFAULT_PLUGINS:
        if module_name != __name__:
            pm.register(importlib.import_module(module_name), name=module_name)
    return {
        kind: tuple(name for name in names if name not in pm.registry(kind).entries)
        for kind, names in DEFAULT_CONFIG_NAMES.items()
    }


def _register(kind: str, register: Any) -> None:
    for name in missing_names()[kind]:
        register(name, not_implemented)


@hookimpl
def register_advantage_estimators(register):
    _register("advantage_estimator", register)


@hookimpl
def register_policy_losses(register):
    _register("policy_loss", register)


@hookimpl
def register_kl_estimators(register):
    _register("kl_estimator", register)


@hookimpl
def register_reward_functions(register):
    _register("reward_function", register)


@hookimpl
def register_rollout_engines(register):
    _register("rollout_engine", register)


@hookimpl
def register_training_backends(register):
    _register("training_backend", register)


@hookimpl
def register_loggers(register):
    _register("logger", register)
