"""The configured advantage estimator (``algorithm.advantage``), looked up once: its implementation, its
options, and what its registration declares it needs (``rlite.hookspecs.register_advantage_estimators``).

The config loader, the run builder, the loop and the audit all read the estimator through
:func:`advantage_choice`, never its name and never its metadata directly, so a declaration has one meaning
everywhere. ``needs_group`` may be ``True`` or a function of the estimator's options; it answers two
questions, kept apart here:

* :attr:`AdvantageChoice.needs_group`: with *these* options, does a sample alone in its group get advantage
  0 (so ``rollout.samples_per_prompt=1`` learns nothing and is refused)? The function is called on the options.
* :attr:`AdvantageChoice.group_baseline`: is the baseline the group's at all (declared ``needs_group`` in
  either form)? Then a group whose rewards are all equal teaches nothing, whatever the options, and the loop
  watches for steps made of such groups (:class:`rlite.metrics.LearningSignalWatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlite.config.options import build_options

KIND = "advantage_estimator"
KEY = "algorithm.advantage"


@dataclass(frozen=True)
class AdvantageChoice:
    """The estimator a config selects, resolved (:func:`advantage_choice`)."""

    name: str
    implementation: Callable
    """``fn(batch, options) -> (advantages, returns)``."""
    options: Any
    """Its config instance (None for an estimator without options)."""
    needs_critic: bool
    """It reads critic values (``algorithm.critic.enabled`` required)."""
    needs_group: bool
    """Under these options a lone sample gets advantage 0: ``rollout.samples_per_prompt`` must be >= 2."""
    group_baseline: bool
    """Its baseline comes from the other samples of the prompt (``needs_group`` declared in either form)."""
    group_need_is_optional: bool
    """``needs_group`` was declared as a function of the options: some options lift it."""
    needs_greedy_baseline: bool
    """It reads the reward of one greedy completion per prompt (the rollout stage generates it)."""

    @property
    def resolved(self) -> tuple[Callable, Any]:
        """``(implementation, options)``: what the targets stage calls."""
        return self.implementation, self.options


def needs_group(entry: Any, options: Any) -> bool:
    """Registry ``entry``'s ``needs_group`` declaration evaluated for ``options`` (its config instance)."""
    declared = entry.metadata.get("needs_group", False)
    return bool(declared(options)) if callable(declared) else bool(declared)


def default_options(entry: Any, registries: Mapping[str, Any] | None) -> Any:
    """An estimator's options when the config gives none."""
    return build_options(entry, {}, kind=KIND, key=f"{KEY}.args", registries=registries)


def advantage_choice(algorithm: Any, registries: Mapping[str, Any]) -> AdvantageChoice:
    """``algorithm.advantage`` (of an ``AlgorithmConfig``) looked up in ``registries`` (kind -> registry: a
    plugin manager's ``registries``), its options built and its declarations read."""
    choice = algorithm.advantage
    entry = registries[KIND].get(choice.name)
    options = build_options(entry, choice.args, kind=KIND, key=f"{KEY}.args", registries=registries)
    return AdvantageChoice(
        name=entry.name,
        implementation=entry.implementation,
        options=options,
        needs_critic=bool(entry.metadata.get("needs_critic")),
        needs_group=needs_group(entry, options),
        group_baseline=bool(entry.metadata.get("needs_group")),
        group_need_is_optional=callable(entry.metadata.get("needs_group")),
        needs_greedy_baseline=bool(entry.metadata.get("needs_greedy_baseline")),
    )
