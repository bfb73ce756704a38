"""What a registered implementation declares about itself: the one table of registration metadata.

A plugin passes these keys to ``register(name, implementation, config_cls, **metadata)``. rlite's core
reads them, never an implementation's name: the compatibility rules (:mod:`rlite.config.compat`), the
config-check phase (:mod:`rlite.config.loader`), the memory check (:mod:`rlite.run.limits`) and the audit
(:mod:`rlite.tools.audit`). :data:`CAPABILITIES` is the table, one row per key; ``docs/plugins.md`` shows it (a test
keeps the two equal) and :func:`metadata_problem` checks a registration's values against it when the plugin
manager collects the registries. A key a kind's rows do not list is kept as the plugin gave it.

Where a row says *or a function of the options*, the value may be given as a function of the choice's
config instance (``lambda cfg: not cfg.process``); :func:`declared` evaluates it for a run's options.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlite.config.options import build_options

ANY_KIND = "any"
"""The kind of a row that every registration may declare."""


@dataclass(frozen=True)
class Unsupported:
    """A feature of the run that a training backend does not implement (``unsupported={feature: ...}``):
    a config that asks for it is refused when it loads, with ``why`` and ``instead`` in the message."""

    why: str
    """Why the backend cannot honour it (the message's reason: it would be ignored, or what breaks)."""
    instead: str
    """What to set instead; rlite adds the registered backends that implement the feature."""


BACKEND_FEATURES: dict[str, str] = {
    "cpu_offload": "parallelism.cpu_offload",
    "fused_logprobs": "training.liger_fused_logprobs",
    "compile": "training.compile",
    "lora": "model.lora.enabled",
    "critic": "algorithm.critic.enabled",
    "packed_sequences": "training.pack_sequences",
    "true_on_policy": "rollout.true_on_policy",
}
"""The features a training backend may declare ``unsupported``, each the boolean config key that asks for
it (set to true)."""


@dataclass(frozen=True)
class Capability:
    """One row of the table: a metadata key of one kind of registration."""

    kind: str
    """The registry kind (``rollout_engine``, ``training_backend``, ... or :data:`ANY_KIND`)."""
    key: str
    value: str
    """What the value is, as the docs show it."""
    absent: str
    """What a registration that does not declare it gets."""
    meaning: str
    read_by: str
    """Which part of rlite reads it."""
    valid: Callable[[Any], bool] | None = None
    """Checked at registration (None: any value)."""
    per_options: bool = False
    """The value may be a function of the choice's config instance."""


def _names(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)


def _flag(value: Any) -> bool:
    return isinstance(value, bool) or _names(value) or callable(value)


def _unsupported(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        feature in BACKEND_FEATURES and isinstance(reason, Unsupported) for feature, reason in value.items())


CAPABILITIES: tuple[Capability, ...] = (
    Capability(ANY_KIND, "check_config", "`fn(config, cfg)`", "no check",
               "refuses a config this implementation cannot honour: raise `ConfigError` naming the key; called "
               "when the config loads, after validation, with the `RunConfig` and the choice's config instance",
               "config loader", callable),
    Capability("training_backend", "unsupported", "`{feature: Unsupported(why, instead)}`", "supports every feature",
               "features it does not implement (`cpu_offload`, `fused_logprobs`, `compile`, `lora`, `critic`, "
               "`packed_sequences`, `true_on_policy`): a config asking for one is refused when it loads",
               "compatibility rules, `docs/compatibility.md`", _unsupported),
    Capability("training_backend", "model_parallel", "tuple of option names", "`()`",
               "its options that split the model over ranks (each an int, 1: not split)", "audit (a replica in "
               "one process sets them to 1)", _names),
    Capability("training_backend", "trainer_memory", "`fn(config, cfg, parameters, world_size) -> dict`",
               "FSDP2's shards", "the bytes one rank holds, by part", "memory check", callable),
    Capability("rollout_engine", "memory", "`fn(config, cfg, shape, tokens, world_size, on_gpu) -> dict`",
               "nothing counted", "the bytes it holds on the trainer's device, by part (its weights unless it "
               "shares the trainer's, its KV cache); `shape` is the model's `ModelShape`, `tokens` the longest "
               "sequence", "memory check", callable),
    Capability("rollout_engine", "samples_in_process", "bool, or names of options", "False",
               "samples in a thread of the trainer's process (what shares its random generator); as names: the "
               "options of its config class that keep it there", "compatibility rules", _flag, per_options=True),
    Capability("rollout_engine", "shares_weights", "bool, or names of options", "False (checked on the built "
               "engine's `capabilities.shares_weights`)", "set to bind the trainer's own tensors, so it cannot "
               "sample while the trainer updates; as names: the options that set it so",
               "compatibility rules", _flag, per_options=True),
    Capability("rollout_engine", "draft_methods", "tuple of `DraftSpec.method`s", "`()`",
               "the speculative drafts it runs", "config loader", _names),
    Capability("rollout_engine", "from_model", "`fn(model, *, pad_token_id, eos_token_ids) -> RolloutEngine`",
               "not used outside a run", "builds the engine around a Hugging Face model already loaded in this "
               "process; the default engine's is what `rlite chat` and `rlite generate` decode with",
               "`rlite chat`, `rlite generate`", callable),
    Capability("rollout_engine", "available", "`fn()`", "always available",
               "returns None where it can start on this machine, else what it needs (a short phrase)", "audit (another engine in the "
               "replica)", callable),
    Capability("rollout_workflow", "single_turn", "bool", "False",
               "every environment stops after one turn with no reward: sampled as a plain rollout",
               "run builder, compatibility rules, context check"),
    Capability("advantage_estimator", "needs_critic", "bool", "False", "reads `batch.values`", "config loader"),
    Capability("advantage_estimator", "needs_group", "bool, or a function of the options", "False",
               "its baseline comes from the prompt's other samples", "config loader", per_options=True),
    Capability("advantage_estimator", "needs_greedy_baseline", "bool", "False", "reads `batch.baseline_scores`",
               "rollout stage"),
    Capability("advantage_estimator", "reference", "`fn64`", "not audited",
               "the same formula in float64", "audit, conformance kit"),
    Capability("policy_loss", "reference", "`fn64`", "not audited", "the same loss in float64",
               "audit, conformance kit"),
    Capability("speculative_draft", "method", "`model`, `ngram` or `eagle`", "refused", "the kind of draft",
               "config loader"),
    Capability("reward_function", "isolation", "`thread`, `process` or `inline`", "`thread`",
               "where its calls run", "reward runner"),
    Capability("reward_function", "batched", "bool, or a function of the options", "False",
               "called once per batch", "reward runner", per_options=True),
    Capability("reward_function", "check", "`fn(cfg, sample)`", "no check",
               "checks the first data row before training", "reward runner"),
)


def capability(kind: str, key: str) -> Capability | None:
    """The row of ``key`` for registrations of ``kind``, or None."""
    return next((c for c in CAPABILITIES if c.key == key and c.kind in (kind, ANY_KIND)), None)


def metadata_problem(kind: str, metadata: Mapping[str, Any]) -> str | None:
    """What is wrong with a registration's metadata by the table (None: nothing)."""
    for key, value in metadata.items():
        row = capability(kind, key)
        if row is not None and row.valid is not None and not row.valid(value):
            return f"{key}={value!r} is not {row.value} (docs/plugins.md, 'Capabilities')"
    return None


def options_of(entry: Any, args: Mapping[str, Any] | Any, registries: Mapping[str, Any] | None = None) -> Any:
    """The config instance of a registered choice for ``args`` (its options as a dict, or already an
    instance), or None for an implementation without a config class; built as a run builds it
    (:func:`rlite.config.options.build_options`: nested dataclasses as instances, and with ``registries`` a
    nested choice's options as its implementation's config instance)."""
    if entry.config_cls is None:
        return None
    if isinstance(args, entry.config_cls):
        return args
    return build_options(entry, args, kind="choice", key=f"{entry.name} options", registries=registries)


def declared(entry: Any, key: str, options: Any = None) -> Any:
    """``entry``'s declaration of a key whose value may depend on the options (a row with
    ``per_options``), evaluated for ``options`` (the choice's config instance); None when absent."""
    value = entry.metadata.get(key)
    return value(options) if callable(value) else value


def capabilities_markdown() -> str:
    """The table as ``docs/plugins.md`` shows it (a test keeps the two equal)."""
    lines = ["| kind | key | value | without it | what it declares | read by |", "|---|---|---|---|---|---|"]
    for row in CAPABILITIES:
        value = f"{row.value}, or a function of the options" if row.per_options and "function" not in row.value \
            else row.value  # fmt: skip
        lines.append(f"| {row.kind} | `{row.key}` | {value} | {row.absent} | {row.meaning} | {row.read_by} |")
    return "\n".join(lines) + "\n"
