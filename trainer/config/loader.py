"""Loading a run configuration: YAML layers and ``key=value`` overrides merged onto the schema by
omegaconf, then every named choice checked against the plugin registries.

The loader takes the registries it validates against as an argument (anything with
``registry(kind)``, normally the plugin manager); it never builds a plugin manager itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from rlite.config.choices import CHOICE_KEYS, REGISTRY_KINDS
from rlite.config.schema import (
    _SKIP_CHECKS,
    Choice,
    ConfigError,
    RunConfig,
    UnknownChoiceError,
    _check_choice,
)

# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------

def _normalise_choices(node: Any, prefix: str = "") -> Any:
    """Turn the shorthand ``key: name`` into ``key: {name: name}`` for Choice-valued keys."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if path in CHOICE_KEYS:
                if isinstance(value, list):
                    value = [{"name": v} if isinstance(v, str) else v for v in value]
                elif isinstance(value, str):
                    value = {"name": value}
            out[key] = _normalise_choices(value, path)
        return out
    return node


def _parse_overrides(overrides: typing.Sequence[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, _, raw = item.partition("=")
        key = key.strip()
        if key in CHOICE_KEYS and not raw.strip().startswith(("[", "{")):
            key = key if REGISTRY_KINDS[CHOICE_KEYS[key]].many else f"{key}.name"
        value = OmegaConf.create({"v": OmegaConf.from_dotlist([f"v={raw}"]).v} if raw else {"v": ""}).v
        value = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = value
    return tree


def _drop_renamed_choice_args(earlier: dict[str, Any], later: dict[str, Any]) -> None:
    """When ``later`` picks a different implementation for a choice, forget ``earlier``'s args for it.

    Layers merge key by key, so without this ``algorithm.advantage=rloo`` on top of a YAML with
    ``advantage: {name: grpo, args: {...}}`` would validate grpo's options against rloo.
    """
    for key in CHOICE_KEYS:
        old, new = _dict_at(earlier, key), _dict_at(later, key)
        if old is not None and new is not None and "name" in new and new["name"] != old.get("name"):
            old.pop("args", None)


def _dict_at(tree: dict[str, Any], dotted: str) -> dict[str, Any] | None:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) else None


def _schema_keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _explain_omegaconf_error(exc: OmegaConfBaseException) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    msg = str(exc).split("\n")[0]
    text = f"{key}: {msg}"
    if isinstance(exc, MissingMandatoryValue):
        text = f"{key}: missing value; set it in the YAML file or with {key}=..."
    parent_cls = None
    obj_type = getattr(exc, "object_type", None)
    if "not in" in msg and obj_type is not None and dataclasses.is_dataclass(obj_type):
        parent_cls = obj_type
    if parent_cls is not None:
        valid = _schema_keys(parent_cls)
        bad = key.split(".")[-1]
        text = f"{key}: unknown key {bad!r}. Valid keys here: {', '.join(valid)}."
        close = difflib.get_close_matches(bad, valid, n=1)
        if close:
            text += f" Did you mean {close[0]!r}?"
    return ConfigError(text)


def _validate_choice_args(key: str, choice: Choice, registry) -> Choice:
    entry = registry.get(choice.name)
    if entry.config_cls is None:
        if choice.args:
            raise ConfigError(
                f"{key}.args: {registry.kind} {choice.name!r} takes no options, got {sorted(choice.args)}"
            )
        return choice
    try:
        merged = OmegaConf.merge(OmegaConf.structured(entry.config_cls), choice.args)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        inner = _explain_omegaconf_error(exc)
        raise ConfigError(f"{key}.args.{str(inner)}") from None
    except (ValueError, TypeError) as exc:  # a plugin's own __post_init__ check (ConfigError included)
        raise ConfigError(f"{key}.args: {exc}") from None
    return Choice(choice.name, dataclasses.asdict(obj))


def validate_choices(cfg: RunConfig, pm) -> None:
    """Check every named choice against its registry and validate its args (in place)."""
    for key, kind in CHOICE_KEYS.items():
        section, _, attr = key.rpartition(".")
        owner = cfg if not section else _get_path(cfg, section)
        value = getattr(owner, attr)
        registry = pm.registry(kind)
        choices = value if isinstance(value, list) else [value]
        validated = []
        for index, choice in enumerate(choices):
            path = f"{key}[{index}]" if isinstance(value, list) else key
            if REGISTRY_KINDS[kind].optional and choice.name == "none":
                validated.append(choice)
                continue
            try:
                validated.append(_validate_choice_args(path, choice, registry))
            except UnknownChoiceError as exc:
                msg = str(exc).replace(registry.config_key, path, 1)
                raise ConfigError(msg) from None
        setattr(owner, attr, validated if isinstance(value, list) else validated[0])
    estimator = pm.registry("advantage_estimator").get(cfg.algorithm.advantage.name)
    if estimator.metadata.get("needs_critic") and not cfg.algorithm.critic.enabled:
        raise ConfigError(
            f"algorithm.advantage={estimator.name} needs a critic: set algorithm.critic.enabled=true"
        )
    check_draft_runs_on_engine(cfg, pm)
    check_workflow(cfg, pm)
    kl_names = pm.registry("kl_estimator").names()
    if cfg.algorithm.kl.estimator not in kl_names:
        _check_choice("algorithm.kl.estimator", cfg.algorithm.kl.estimator, kl_names)


def check_workflow(cfg: RunConfig, pm) -> None:
    """A multi-turn workflow samples turn by turn from growing contexts: what needs one fixed-shape call per
    sample (true on-policy sampling, speculative drafts fed the policy's top log-probs) is refused."""
    workflow = pm.registry("rollout_workflow").get(cfg.rollout.workflow.name)
    if workflow.metadata.get("single_turn"):
        return
    for on, key in ((cfg.rollout.true_on_policy, "rollout.true_on_policy=false"),
                    (cfg.rollout.draft.name != "none", "rollout.draft=none")):  # fmt: skip
        if on:
            raise ConfigError(
                f"rollout.workflow={workflow.name} is multi-turn, which is not supported with this setting yet: set {key}"
            )


def check_draft_runs_on_engine(cfg: RunConfig, pm) -> None:
    """The draft's kind (its registration's ``method``) must be one the engine runs (its registration's
    ``draft_methods``)."""
    if cfg.rollout.draft.name == "none":
        return
    draft = pm.registry("speculative_draft").get(cfg.rollout.draft.name)
    method = draft.metadata.get("method")
    if method is None:
        raise ConfigError(
            f"rollout.draft={draft.name}: plugin {draft.plugin!r} registered it without method=... "
            "(model, ngram or eagle), so no engine can be checked to run it"
        )
    engines = pm.registry("rollout_engine")
    engine = engines.get(cfg.rollout.engine.name)
    if method not in engine.metadata.get("draft_methods", ()):
        able = [e.name for e in engines.entries.values() if method in e.metadata.get("draft_methods", ())]
        raise ConfigError(
            f"rollout.draft={draft.name}: the {engine.name!r} engine cannot run a {method!r} draft "
            f"(it runs: {', '.join(engine.metadata.get('draft_methods', ())) or 'no drafts'}); set rollout.draft=none"
            + (f" or rollout.engine to one that runs it ({', '.join(able)})" if able else "")
        )


def _get_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = (), pm=None) -> RunConfig:
    """Load YAML (optional) plus ``key=value`` overrides into a validated :class:`RunConfig`.

    Overrides beat the YAML. Named choices are checked against the registries of ``pm`` (the plugin
    manager, or anything with ``registry(kind)``); ``pm=False`` skips that check.
    """
    token = _SKIP_CHECKS.set(True)
    try:
        schema = OmegaConf.structured(RunConfig)
    finally:
        _SKIP_CHECKS.reset(token)
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found")
        try:
            raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        except Exception as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        layers.append(_normalise_choices(raw))
    layers.append(_normalise_choices(_parse_overrides(overrides)))
    for index, later in enumerate(layers[1:], start=1):
        for earlier in layers[:index]:
            _drop_renamed_choice_args(earlier, later)
    try:
        merged = schema
        for layer in layers:
            merged = OmegaConf.merge(merged, layer)
        cfg: RunConfig = OmegaConf.to_object(merged)  # runs every __post_init__
    except OmegaConfBaseException as exc:
        if isinstance(exc.__cause__, ConfigError):
            raise ConfigError(str(exc.__cause__)) from None
        raise _explain_omegaconf_error(exc) from None
    except ConfigError as exc:
        raise ConfigError(str(exc).split("\n")[0]) from None
    if pm is None:
        raise TypeError("load_config: pass the plugin manager whose registries check the config (or pm=False)")
    if pm is not False:
        validate_choices(cfg, pm)
    return cfg


def config_to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
