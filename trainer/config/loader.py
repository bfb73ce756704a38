"""Loading a run configuration: YAML layers and ``key=value`` overrides merged onto the schema by
omegaconf, then every named choice checked against the plugin registries.

The loader takes the registries it validates against as an argument (anything with
``registry(kind)``, normally the plugin manager); it never builds a plugin manager itself.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlite.config.advantage import AdvantageChoice, advantage_choice, default_options, needs_group
from rlite.config.capabilities import options_of
from rlite.config.choices import CHOICE_KEYS, REGISTRY_KINDS
from rlite.config.compat import check_compatibility
from rlite.config.options import build_options, explain_omegaconf_error, options_as_args
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


def _parse_value(raw: str) -> Any:
    """An override's value in omegaconf's dotlist grammar (YAML: ``[a, b]``, ``{k: v}``, numbers,
    ``null``; ``key=`` is null and ``key=''`` the empty string); interpolations stay unresolved."""
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)["v"]


def _choice_key(parts: list[str]) -> tuple[str | None, bool]:
    """The Choice-valued key that ``parts`` addresses (a list-valued choice key's element counts as
    one choice), and whether it addresses the whole list of a list-valued key."""
    if len(parts) >= 2 and parts[-1].isdigit():
        key = ".".join(parts[:-1])
        if key in CHOICE_KEYS and REGISTRY_KINDS[CHOICE_KEYS[key]].many:
            return key, False
    key = ".".join(parts)
    if key in CHOICE_KEYS:
        return key, REGISTRY_KINDS[CHOICE_KEYS[key]].many
    return None, False


def _walk(cfg: DictConfig, parts: list[str], item: str) -> Any:
    """The node ``parts`` names, or None where it does not exist yet; list indices are checked here so
    that a bad one names the list and its length."""
    node: Any = cfg
    for depth, part in enumerate(parts):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, ListConfig):
            if not part.isdigit() or int(part) >= len(node):
                parent = ".".join(parts[:depth])
                raise ConfigError(
                    f"override {item!r}: {parent} is a list of {len(node)} entr{'y' if len(node) == 1 else 'ies'}, "
                    f"so {where} does not exist; address an entry by its index 0..{len(node) - 1}, or set the "
                    f"whole list with {parent}=[...]"
                )
            node = node[int(part)]
        elif isinstance(node, DictConfig):
            if part not in node:
                return None  # omegaconf says whether this key may be added
            node = node[part]
        else:
            parent = ".".join(parts[:depth])
            raise ConfigError(f"override {item!r}: {parent} is a value, not a section, so it has no key {part!r}")
    return node


def _normalise_choice(value: Any, key: str, item: str) -> dict[str, Any]:
    """A choice's shorthand name as ``{name: ...}``; anything but a name or a mapping with one is refused."""
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict) and set(value) <= {"name", "args"} and isinstance(value.get("args", {}), dict):
        return value
    raise ConfigError(
        f"override {item!r}: {key} takes an implementation's name ({key}=NAME) or a mapping "
        f"({key}={{name: NAME, args: {{...}}}}), got {value!r}"
    )


def apply_override(cfg: DictConfig, item: str) -> None:
    """Apply one ``key.path=value`` override to the merged config, in omegaconf's dotlist grammar.

    List entries are addressed by index (``rewards.0.args.weight=2``). A named choice takes the
    shorthand name (``algorithm.advantage=rloo``, ``rewards=exact_match``, ``logging.loggers=[jsonl]``);
    a choice given a different implementation than before forgets the old one's ``args``.
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or not all(parts):
        raise ConfigError(f"override {item!r} must look like key.path=value")
    try:
        value = _parse_value(raw)
    except Exception as exc:  # yaml's parser errors span many lines; one is enough to see the problem
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"override {item!r}: the value {raw!r} does not parse ({problem}): close its brackets "
                          "and quotes, and quote the whole item in the shell") from None
    choice, whole_list = _choice_key(parts)
    if choice is None and parts[-1] == "name":
        element, whole = _choice_key(parts[:-1])
        if element is not None and not whole:  # ``<choice>.name=...``: the same as ``<choice>=...``
            choice, parts, value = element, parts[:-1], {"name": value}
    if choice is not None:
        if whole_list:
            value = [_normalise_choice(v, choice, item) for v in (value if isinstance(value, list) else [value])]
        else:
            value = _normalise_choice(value, choice, item)
            current = _walk(cfg, parts, item)
            renamed = isinstance(value, dict) and "name" in value and isinstance(current, DictConfig)
            if renamed and value["name"] != current.get("name"):
                current["args"] = {}  # another implementation: the old one's options do not apply
    else:
        _walk(cfg, parts, item)
        value = _normalise_choices(value, key) if isinstance(value, dict) else value  # a section: algorithm={...}
    try:
        OmegaConf.update(cfg, ".".join(parts), value, merge=True)
    except OmegaConfBaseException as exc:
        raise _explain_omegaconf_error(exc) from None
    except (TypeError, ValueError) as exc:  # omegaconf's own, for values that do not fit the node
        raise ConfigError(f"override {item!r}: cannot set {key}: {exc}") from None


def _explain_omegaconf_error(exc: OmegaConfBaseException) -> ConfigError:
    return ConfigError(explain_omegaconf_error(exc))


def _validate_choice_args(key: str, choice: Choice, registry, registries=None) -> Choice:
    """``choice.args`` built into the entry's config dataclass and back (:mod:`rlite.config.options`): the
    defaults filled in, nested dataclasses and nested choices checked, errors naming the full key."""
    entry = registry.get(choice.name)
    options = build_options(entry, choice.args, kind=registry.kind, key=f"{key}.args", registries=registries)
    return Choice(choice.name, options_as_args(options, entry.config_cls))


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
                validated.append(_validate_choice_args(path, choice, registry, pm.registries))
            except UnknownChoiceError as exc:
                msg = str(exc).replace(registry.config_key, path, 1)
                raise ConfigError(msg) from None
        setattr(owner, attr, validated if isinstance(value, list) else validated[0])
    kl_names = pm.registry("kl_estimator").names()
    if cfg.algorithm.kl.estimator not in kl_names:
        _check_choice("algorithm.kl.estimator", cfg.algorithm.kl.estimator, kl_names)


# --------------------------------------------------------------------------------------------------
# the config-check phase
# --------------------------------------------------------------------------------------------------


def check_config(cfg: RunConfig, pm) -> None:
    """The one phase that refuses a valid config which cannot run, when it loads: what the chosen
    implementations declare they need (a critic, a group of samples, an engine that runs the draft, a
    correction that bypass mode does not reduce to a no-op), the pairs of settings that do not combine
    (:func:`rlite.config.compat.check_compatibility`, with the backends' and engines' declared
    capabilities), then each chosen implementation's own ``check_config`` (:func:`check_plugins`).

    Refusals that need a fact of the started run stay where the fact is known: the world size, the model's
    files (its context, its Mixture-of-Experts layers, a draft's vocabulary), the device and its free
    memory, and what a built engine or backend reports of itself (``capabilities``) where its plugin
    declared nothing."""
    advantage = advantage_choice(cfg.algorithm, pm.registries)
    if advantage.needs_critic and not cfg.algorithm.critic.enabled:
        raise ConfigError(
            f"algorithm.advantage={advantage.name} needs a critic: set algorithm.critic.enabled=true"
        )
    check_group_size(cfg, advantage, pm.registries)
    check_draft_runs_on_engine(cfg, pm)
    check_bypass_corrections(cfg, pm)
    check_compatibility(cfg, pm)
    check_plugins(cfg, pm)


def chosen(cfg: RunConfig, pm) -> Iterator[tuple[str, Any, Any]]:
    """``(key, registered entry, config instance)`` of every implementation the config chooses, in the
    order of the registry kinds, a list's entries in order and a wrapper's inner choice (a ``choice_of``
    option) after the wrapper; ``none`` of an optional kind chooses nothing."""
    for kind, choice_kind in REGISTRY_KINDS.items():
        value = _get_path(cfg, choice_kind.key)
        many = isinstance(value, list)
        for index, choice in enumerate(value if many else [value]):
            name, args = (choice.name, choice.args) if choice_kind.named_choice else (choice, {})
            if choice_kind.optional and name == "none":
                continue
            key = f"{choice_kind.key}[{index}]" if many else choice_kind.key
            yield from _with_inner(key, pm.registry(kind).get(name), args, pm)


def _with_inner(key: str, entry, args, pm) -> Iterator[tuple[str, Any, Any]]:
    options = options_of(entry, args, pm.registries)
    yield key, entry, options
    if options is None or not dataclasses.is_dataclass(options):
        return
    for option in dataclasses.fields(options):
        kind = option.metadata.get("choice_of")
        if kind is not None:
            inner = pm.registry(kind).get(getattr(options, option.name))
            yield from _with_inner(f"{key}.args.{option.name}", inner, getattr(options, f"{option.name}_args", None), pm)


def check_plugins(cfg: RunConfig, pm) -> None:
    """Call the ``check_config(config, cfg)`` that each chosen implementation registered (with the run config
    and its own config instance); a ``ConfigError`` it raises stops the load, prefixed with the choice's key,
    name and plugin."""
    for key, entry, options in chosen(cfg, pm):
        check = entry.metadata.get("check_config")
        if check is None:
            continue
        try:
            check(cfg, options)
        except ConfigError as exc:
            raise ConfigError(f"{key}={entry.name} (plugin {entry.plugin!r}): {exc}") from None


def check_group_size(cfg: RunConfig, advantage: AdvantageChoice, registries) -> None:
    """A group-relative estimator (registered with ``needs_group``) needs ``samples_per_prompt >= 2``:
    with one sample per prompt its baseline is the sample itself and every advantage is 0."""
    if cfg.rollout.samples_per_prompt > 1 or not advantage.needs_group:
        return
    estimators = registries["advantage_estimator"]
    able = [e.name for e in estimators.entries.values() if not needs_group(e, default_options(e, registries))]
    options = f" (or algorithm.advantage.args under which {advantage.name} needs no group: for the built-ins singleton=raw, " \
        "which gives a lone sample its raw reward)" if advantage.group_need_is_optional else ""  # fmt: skip
    raise ConfigError(
        f"rollout.samples_per_prompt=1: algorithm.advantage={advantage.name} compares each sample with the other "
        f"samples of its prompt, so with one sample per prompt every advantage is 0 and nothing is learned. "
        f"Sample several per prompt (rollout.samples_per_prompt=2 or more) or use an estimator that works with "
        f"one sample: {', '.join(sorted(able)) or '(none installed)'}{options}"
    )


def check_bypass_corrections(cfg: RunConfig, pm) -> None:
    """In bypass mode pi_old is the engine's log-probs, so a correction computed before the update on
    rho = pi_old / pi_rollout sees rho = 1 and does nothing: refuse it rather than run it as a no-op.
    Corrections that read the current log-probs (they declare ``logprobs``, e.g. OPSM) run at loss time
    on pi_theta against pi_old = pi_rollout and stay allowed."""
    if cfg.algorithm.old_logprob_mode != "bypass":
        return
    from rlite.algorithms.mismatch import declared_kwargs  # torch: only when a config uses bypass

    registry = pm.registry("mismatch_correction")
    for index, choice in enumerate(cfg.algorithm.corrections):
        if "logprobs" not in declared_kwargs(registry.get(choice.name).implementation):
            raise ConfigError(
                f"algorithm.corrections[{index}]={choice.name}: with algorithm.old_logprob_mode=bypass, pi_old is the "
                "engine's log-probs, so this correction's ratio pi_old/pi_rollout is exactly 1 and it would do nothing; "
                "use algorithm.old_logprob_mode=decoupled (pi_old recomputed by the trainer), or for truncated IS "
                "against the rollout in bypass mode algorithm.policy_loss=reinforce_tis"
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


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = (), pm=None, *, check: bool = True) -> RunConfig:
    """Load YAML (optional) plus ``key=value`` overrides into a validated :class:`RunConfig`.

    Overrides beat the YAML and apply in order (:func:`apply_override`: omegaconf's dotlist grammar). Named choices are checked against the registries of ``pm`` (the plugin
    manager, or anything with ``registry(kind)``), then the config-check phase runs (:func:`check_config`);
    ``pm=False`` skips both but for the rules that read no registration, and ``check=False`` those too (a
    first read for the ``plugins`` section alone, whose refusals the full load reports in their order).
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
    try:
        merged = schema
        for layer in layers:
            merged = OmegaConf.merge(merged, layer)
        for item in overrides:
            apply_override(merged, item)
        if not merged.logging.run_dir:  # each config file its own run folder, so runs never resume each other
            merged.logging.run_dir = str(Path("runs") / (path.stem if path is not None else "rlite"))
        cfg: RunConfig = OmegaConf.to_object(merged)  # runs every __post_init__
    except OmegaConfBaseException as exc:
        if isinstance(exc.__cause__, ConfigError):
            raise ConfigError(str(exc.__cause__)) from None
        raise _explain_omegaconf_error(exc) from None
    except ConfigError as exc:
        raise ConfigError(str(exc).split("\n")[0]) from None
    if pm is None:
        raise TypeError("load_config: pass the plugin manager whose registries check the config (or pm=False)")
    if pm is False:
        if check:
            check_compatibility(cfg)  # only the rules that read no plugin's registration
    else:
        validate_choices(cfg, pm)
        check_config(cfg, pm)
    return cfg


def literal_strings(node: Any) -> Any:
    """``node`` (plain data: dicts, lists, values) with every ``${`` escaped, so that omegaconf reads each
    string as it is rather than as an interpolation to resolve."""
    if isinstance(node, dict):
        return {key: literal_strings(value) for key, value in node.items()}
    if isinstance(node, list):
        return [literal_strings(value) for value in node]
    return node.replace("${", "\\${") if isinstance(node, str) else node


def config_from_data(data: dict[str, Any], where: str) -> RunConfig:
    """A :class:`RunConfig` from plain data (a parsed YAML mapping): every string literal (no interpolation is
    resolved), the schema's types and ``__post_init__`` checks applied, and no named choice looked up in a
    registry, so nothing is imported. For reading another run's settings as data (``rlite chat RUN_DIR``);
    ``where`` names the source in messages."""
    token = _SKIP_CHECKS.set(True)
    try:
        schema = OmegaConf.structured(RunConfig)
    finally:
        _SKIP_CHECKS.reset(token)
    try:
        merged = OmegaConf.merge(schema, _normalise_choices(literal_strings(data)))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        if isinstance(exc.__cause__, ConfigError):
            raise ConfigError(f"{where}: {exc.__cause__}") from None
        raise ConfigError(f"{where}: {_explain_omegaconf_error(exc)}") from None
    except ConfigError as exc:
        raise ConfigError(f"{where}: {str(exc).splitlines()[0]}") from None


def config_to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
