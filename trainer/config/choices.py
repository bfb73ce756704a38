"""The kinds of named choice: which registration hook fills each registry and which config key
selects from it. The plugin manager builds its registries from this table and the config loader
derives its choice keys from it, so a new kind is declared once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChoiceKind:
    hook: str
    """The registration hook (``rlite.hookspecs``) whose implementations fill the registry."""
    key: str
    """The config key that selects from it."""
    many: bool = False
    """The key holds a list of choices (applied in order or summed)."""
    optional: bool = False
    """The name ``none`` switches the feature off."""
    named_choice: bool = True
    """The key holds a :class:`~rlite.config.schema.Choice` (name and args); else a bare name."""


REGISTRY_KINDS: dict[str, ChoiceKind] = {
    "advantage_estimator": ChoiceKind("register_advantage_estimators", "algorithm.advantage"),
    "policy_loss": ChoiceKind("register_policy_losses", "algorithm.policy_loss"),
    "kl_estimator": ChoiceKind("register_kl_estimators", "algorithm.kl.estimator", named_choice=False),
    "mismatch_correction": ChoiceKind("register_mismatch_corrections", "algorithm.corrections", many=True),
    "rollout_quantizer": ChoiceKind("register_rollout_quantizers", "rollout.quantization", optional=True),
    "speculative_draft": ChoiceKind("register_speculative_drafts", "rollout.draft", optional=True),
    "training_backend": ChoiceKind("register_training_backends", "parallelism.backend"),
    "rollout_engine": ChoiceKind("register_rollout_engines", "rollout.engine"),
    "rollout_workflow": ChoiceKind("register_rollout_workflows", "rollout.workflow"),
    "reward_function": ChoiceKind("register_reward_functions", "rewards", many=True),
    "logger": ChoiceKind("register_loggers", "logging.loggers", many=True),
}

CHOICE_KEYS: dict[str, str] = {k.key: kind for kind, k in REGISTRY_KINDS.items() if k.named_choice}
"""Config key -> the registry kind that validates it, for every Choice-valued key."""
