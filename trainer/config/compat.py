"""Which settings combine: the one list of pairs of settings that rlite refuses, and the check that applies it.

A :class:`Rule` names two :class:`Setting` s ("``training.compile=true`` with
``training.share_prompt_prefix=true``"), why they do not combine and what to use instead. :data:`RULES` are
rlite's own; :func:`rules` adds those that the plugins' registrations declare (:mod:`rlite.config.capabilities`):
a training backend's ``unsupported`` features, and the keys derived from an engine's ``samples_in_process`` and
``shares_weights`` and a workflow's ``single_turn``, so that no rule here names a plugin. A run whose
settings match both sides of a rule stops with a :class:`~rlite.config.schema.ConfigError` (exit
status 2) naming both keys. Most rules read only the config and are checked when it loads
(:func:`check_compatibility` from :func:`rlite.config.load_config`); a few need a fact that is known
only once the run starts (its number of ranks, whether the model has Mixture-of-Experts layers) and
are checked there, by the same function given that fact.

Everything that combines is meant to run: ``tests/matrix`` runs an all-pairs covering set of the
options users combine (:mod:`rlite.tools.matrix`), and ``docs/compatibility.md`` is generated from this list.
A setting that one backend or engine would silently ignore belongs here, refused, rather than ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlite.config.capabilities import BACKEND_FEATURES, declared, options_of
from rlite.config.schema import Choice, ConfigError

RUN_FACTS = ("world_size", "model.moe", "model.records_routing")
"""Keys of :class:`Setting` s that the config alone does not decide: the number of data-parallel ranks
and whether the model has Mixture-of-Experts layers. Rules on them are checked when the run starts."""


@dataclass(frozen=True)
class Setting:
    """One side of a rule: the value at ``key`` (a dotted config key, a named choice by its name, or one
    of :data:`RUN_FACTS`) for which ``matches`` is true; ``shown`` describes those values in the docs."""

    key: str
    matches: Callable[[Any], bool]
    shown: str
    described: Callable[[Mapping[str, Any]], str] | None = None
    """How a message names the setting when ``key`` is derived (the config keys it comes from)."""
    example: tuple[str, ...] = ()
    """Overrides that give a config this setting (the refusal tests use them)."""
    names: tuple[str, ...] = ()
    """The config keys a message about this setting names (default: ``key``)."""

    @property
    def named_keys(self) -> tuple[str, ...]:
        return self.names or (self.key,)

    def describe(self, values: Mapping[str, Any]) -> str:
        """The setting as a run has it, for a message: ``key=value``."""
        if self.described is not None:
            return self.described(values)
        return f"{self.key}={_yaml(values[self.key])}"


def equals(key: str, value: Any) -> Setting:
    return Setting(key, lambda v: v == value, f"{key}={_yaml(value)}", example=(f"{key}={_yaml(value)}",))


def differs(key: str, value: Any, *example: str) -> Setting:
    return Setting(key, lambda v: v != value, f"{key}!={_yaml(value)}", example=example)


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Rule:
    """``a`` with ``b`` is refused: ``why``; ``instead`` says what to set."""

    a: Setting
    b: Setting
    why: str
    instead: str

    @property
    def at_start(self) -> bool:
        """Checked when the run starts (a side is a run fact), not when the config loads."""
        return self.a.key in RUN_FACTS or self.b.key in RUN_FACTS

    def applies(self, values: Mapping[str, Any]) -> bool:
        """Both sides match ``values`` (a key missing from them: not known yet, no match)."""
        if any(side.key not in values for side in (self.a, self.b)):
            return False
        return self.a.matches(values[self.a.key]) and self.b.matches(values[self.b.key])

    def message(self, values: Mapping[str, Any]) -> str:
        return f"{self.a.describe(values)} with {self.b.describe(values)}: {self.why}; {self.instead}"


MULTI_TURN = Setting("rollout.multi_turn", bool, "a multi-turn rollout.workflow",
                     lambda v: f"rollout.workflow={v['rollout.workflow']} (multi-turn)",
                     example=("rollout.workflow=arithmetic_chain",), names=("rollout.workflow",))
OVERLAPS = Setting("rollout.overlaps", bool, "rollout.mode=one_step_off, or async with max_staleness > 0",
                   lambda v: f"rollout.mode={v['rollout.mode']}" + (
                       f" (rollout.max_staleness={v['rollout.max_staleness']})" if v["rollout.mode"] == "async" else ""),
                   example=("rollout.mode=one_step_off",), names=("rollout.mode",))
SHARES_WEIGHTS = Setting("rollout.engine_shares_weights", bool,
                         "an engine set to bind the trainer's own tensors (its registration's shares_weights)",
                         lambda v: _engine_by(v, "rollout.engine_shares_weights", "binds the trainer's own tensors"),
                         example=("rollout.engine.args.share_weights=true",), names=("rollout.engine",))
DENSE_MODEL = Setting("model.moe", lambda moe: not moe, "a dense model (no Mixture-of-Experts layers)",
                      lambda v: f"the dense model model.path={v['model.path']!r}", names=("model.path",))
RECORDS_ROUTING = Setting("model.records_routing", bool,
                          "an MoE model with algorithm.routing_replay=rollout or algorithm.routing_metrics=true",
                          lambda v: f"the MoE model model.path={v['model.path']!r} with algorithm.routing_replay="
                                    f"{v['algorithm.routing_replay']} and algorithm.routing_metrics="
                                    f"{_yaml(v['algorithm.routing_metrics'])}",
                          names=("algorithm.routing_replay", "algorithm.routing_metrics"))
MOE_MODEL = Setting("model.moe", bool, "a Mixture-of-Experts model",
                    lambda v: f"the Mixture-of-Experts model model.path={v['model.path']!r}", names=("model.path",))
PARTIAL = differs("rollout.partial_segment_tokens", 0, "rollout.mode=async", "rollout.engine.args.process=true",
                  "rollout.partial_segment_tokens=2")
SINGLE_TURN = Setting("rollout.multi_turn", lambda v: not v, "a single-turn rollout.workflow",
                      lambda v: f"rollout.workflow={v['rollout.workflow']} (single turn)", names=("rollout.workflow",))
NOT_ASYNC = Setting("rollout.mode", lambda v: v != "async", "rollout.mode=sync or one_step_off")
TURN_SETTINGS_IGNORED = ("only a multi-turn workflow samples turn by turn against an environment, so it would be "
                         "silently ignored")
SAMPLES_IN_THREAD = Setting("rollout.samples_in_thread", bool,
                            "rollout.mode=one_step_off or async (max_staleness > 0) with an engine that samples in "
                            "the trainer's process (its registration's samples_in_process)",
                            lambda v: f"rollout.mode={v['rollout.mode']} with "
                                      + _engine_by(v, "rollout.samples_in_thread", "samples in the trainer's process"),
                            example=("rollout.mode=one_step_off", "rollout.engine.args.share_weights=false"),
                            names=("rollout.mode", "rollout.engine"))
LORA_DROPOUT = Setting("model.lora.dropout_active", bool, "model.lora.enabled=true with model.lora.dropout > 0",
                       lambda v: f"model.lora.dropout={v['model.lora.dropout']}",
                       example=("model.lora.enabled=true", "model.lora.dropout=0.05"), names=("model.lora.dropout",))
TRUE_ON_POLICY = equals("rollout.true_on_policy", True)
DRAFT = differs("rollout.draft", "none", "rollout.draft=ngram")


RULES: tuple[Rule, ...] = (
    # -- memory settings ----------------------------------------------------------------------------
    Rule(equals("training.optimizer_offload", "disk"), differs("model.dtype", "float32", "model.dtype=bfloat16"),
         "the disk-offloaded AdamW steps float32 weights (torch's fused kernel on float32 moment files)",
         "set model.dtype=float32 (parallelism.param_dtype=bfloat16 still computes in bf16 over float32 master "
         "weights), or training.optimizer_offload=none"),
    Rule(equals("training.compile", True), equals("training.share_prompt_prefix", True),
         "the shared-prompt forward hands each decoder block a KV cache indexed by the block's layer number, which "
         "torch.compile specialises per layer and per pass, past its recompile limit (the blocks would run eager)",
         "set training.share_prompt_prefix=false with training.compile=true (each prompt then runs once per sample), "
         "or training.compile=false"),
    Rule(equals("training.liger_fused_logprobs", True),
         differs("algorithm.entropy_coef", 0.0, "algorithm.entropy_coef=0.01"),
         "liger's fused linear cross-entropy returns the log-probs without the entropy's gradient, so the entropy "
         "term would train nothing", "set algorithm.entropy_coef=0, or training.liger_fused_logprobs=auto (it then "
         "keeps rlite's chunked output layer whenever the loss has an entropy term) or false"),
    Rule(equals("training.pack_sequences", True), TRUE_ON_POLICY,
         "true on-policy mode scores the engine's own padded layout so that the log-probs are bitwise the engine's, "
         "and a packed forward computes them in another layout", "set one of them to false"),
    # -- rollouts ---------------------------------------------------------------------------------
    Rule(TRUE_ON_POLICY, differs("rollout.quantization", "none", "rollout.quantization=fp8_blockwise"),
         "the engine samples with quantized weights, so its log-probs cannot equal the full-precision trainer's "
         "bitwise", "set rollout.quantization=none, or rollout.true_on_policy=false (a correction such as "
         "algorithm.corrections=[tis] handles the mismatch)"),
    Rule(PARTIAL, TRUE_ON_POLICY, "segments are not joined for this setting yet",
         "set rollout.true_on_policy=false or rollout.partial_segment_tokens=0"),
    Rule(PARTIAL, DRAFT, "segments are not joined for this setting yet",
         "set rollout.draft=none or rollout.partial_segment_tokens=0"),
    Rule(MULTI_TURN, TRUE_ON_POLICY,
         "a multi-turn workflow samples turn by turn from growing contexts, and true on-policy sampling needs one "
         "fixed-shape call per sample; it is not supported yet", "set rollout.true_on_policy=false"),
    Rule(MULTI_TURN, DRAFT,
         "a multi-turn workflow samples turn by turn from growing contexts, and a draft is fed one fixed-shape call "
         "per sample; it is not supported yet", "set rollout.draft=none"),
    Rule(differs("rollout.max_staleness", 1, "rollout.max_staleness=3"), NOT_ASYNC,
         "max_staleness bounds how many versions an asynchronous sample may lag the weights it trains; a sync "
         "sample lags 0 and a one_step_off sample exactly 1, so it would be silently ignored",
         "set rollout.mode=async, or leave rollout.max_staleness out"),
    Rule(differs("rollout.max_turns", 4, "rollout.max_turns=2"), SINGLE_TURN, TURN_SETTINGS_IGNORED,
         "set a multi-turn rollout.workflow (calculator, arithmetic_chain, ...), or leave rollout.max_turns out"),
    Rule(differs("rollout.max_response_tokens", 256, "rollout.max_response_tokens=64"), SINGLE_TURN,
         TURN_SETTINGS_IGNORED.replace("so it", "so its response budget"),
         "set rollout.max_new_tokens for a single-turn response, or a multi-turn rollout.workflow"),
    Rule(differs("rollout.observation_role", "user", "rollout.observation_role=tool"), SINGLE_TURN,
         TURN_SETTINGS_IGNORED.replace("so it", "so the role of its observations"),
         "set a multi-turn rollout.workflow, or leave rollout.observation_role out"),
    Rule(LORA_DROPOUT, SAMPLES_IN_THREAD,
         "an engine in the trainer's process samples in a thread of it, seeding torch's global random "
         "generator for each call and restoring it after, and LoRA dropout in the training thread draws from that "
         "same generator: its masks would repeat and the samples would depend on the threads' timing",
         "set model.lora.dropout=0 (usual in RL), the engine in its own process (change the rollout.engine.args "
         "named), or rollout.mode=sync"),
    Rule(OVERLAPS, SHARES_WEIGHTS,
         "the engine samples while the trainer updates, so it needs its own copy of the weights",
         "leave out the rollout.engine.args named above (the built-in engine's default then keeps its own copy in "
         "these modes), set them the other way, or set rollout.mode=sync"),
    # -- facts known when the run starts ------------------------------------------------------------
    Rule(equals("algorithm.routing_replay", "rollout"), DENSE_MODEL,
         "the model has no Mixture-of-Experts layers (nothing to replay)", "set algorithm.routing_replay=none"),
    Rule(equals("model.lora.enabled", True), MOE_MODEL,
         "peft wraps the fused expert weights of a Mixture-of-Experts model, and the weight sync cannot merge "
         "those adapters yet (the first sync failed: LoRA layers left unmerged)",
         "set model.lora.enabled=false (full fine-tuning) for a Mixture-of-Experts model"),
    Rule(PARTIAL, RECORDS_ROUTING, "MoE routing is recorded per engine call and not joined across segments yet",
         "set rollout.partial_segment_tokens=0, or algorithm.routing_replay=none and algorithm.routing_metrics=false"),
    Rule(MULTI_TURN, RECORDS_ROUTING, "MoE routing is not recorded for multi-turn rollouts yet",
         "set algorithm.routing_replay=none and algorithm.routing_metrics=false"),
    Rule(DRAFT, RECORDS_ROUTING,
         "routing replay and routing metrics record the engine's routing token by token, which speculative "
         "verification does not report", "set rollout.draft=none, or algorithm.routing_replay=none and "
         "algorithm.routing_metrics=false"),
)


# --------------------------------------------------------------------------------------------------
# a run's values, by key
# --------------------------------------------------------------------------------------------------


def flat_values(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of the config by dotted key; a named choice is its name (its options under ``key.args.*``)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        key, value = f"{prefix}{f.name}", getattr(cfg, f.name)
        if isinstance(value, Choice):
            out[key] = value.name
            out.update({f"{key}.args.{k}": v for k, v in value.args.items()})
        elif dataclasses.is_dataclass(value):
            out.update(flat_values(value, f"{key}."))
        else:
            out[key] = value
    return out


def derive(values: dict[str, Any], pm: Any = None) -> dict[str, Any]:
    """``values`` plus the few keys that rules read and that are functions of several settings. With ``pm``
    (anything with ``registry(kind)``) also the keys the plugins' registrations decide: whether the workflow
    is multi-turn, and whether the engine samples in the trainer's process or binds its tensors (without it
    those keys are unknown, and no rule reading them applies)."""
    mode = values["rollout.mode"]
    values["rollout.overlaps"] = mode == "one_step_off" or (mode == "async" and values["rollout.max_staleness"] > 0)
    values["model.lora.dropout_active"] = values["model.lora.enabled"] and values["model.lora.dropout"] > 0
    if pm is not None:
        workflow = pm.registry("rollout_workflow").get(values["rollout.workflow"])
        values["rollout.multi_turn"] = not workflow.metadata.get("single_turn")
        engine = pm.registry("rollout_engine").get(values["rollout.engine"])
        options = options_of(engine, choice_args(values, "rollout.engine"))
        values["rollout.engine_shares_weights"] = declared(engine, "shares_weights", options) or False
        in_process = declared(engine, "samples_in_process", options) or False
        values["rollout.samples_in_thread"] = in_process if values["rollout.overlaps"] else False
    if "model.moe" in values:
        records = values["algorithm.routing_replay"] == "rollout" or values["algorithm.routing_metrics"]
        values["model.records_routing"] = values["model.moe"] and records
    return values


def choice_args(values: dict[str, Any], key: str) -> dict[str, Any]:
    """The options of the choice at ``key`` among flat ``values`` (``key.args.*``)."""
    prefix = f"{key}.args."
    return {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}


def _engine_by(values: Mapping[str, Any], derived: str, what: str) -> str:
    """``rollout.engine=NAME`` and the engine options its registration says make it so (``what``)."""
    named = values[derived]
    options = ", ".join(f"rollout.engine.args.{name}={_yaml(values.get(f'rollout.engine.args.{name}'))}"
                        for name in (named if isinstance(named, (tuple, list)) else ()))  # fmt: skip
    return f"rollout.engine={values['rollout.engine']}" + (f" with {options}" if options else "") + f" ({what})"


def backend_rules(backends: Any) -> tuple[Rule, ...]:
    """A rule for each feature a registered training backend declares ``unsupported``
    (:data:`rlite.config.capabilities.BACKEND_FEATURES`), in the order of the features, then of the names;
    ``instead`` ends with the backends that implement it."""
    out = []
    entries = [backends.entries[name] for name in backends.names()]
    for feature, key in BACKEND_FEATURES.items():
        able = [e.name for e in entries if feature not in (e.metadata.get("unsupported") or {})]
        for entry in entries:
            reason = (entry.metadata.get("unsupported") or {}).get(feature)
            if reason is None:
                continue
            also = f", or use parallelism.backend={' or '.join(able)}, which implements it" if able else ""
            out.append(Rule(equals("parallelism.backend", entry.name), equals(key, True), reason.why,
                            reason.instead + also))
    return tuple(out)


def rules(pm: Any = None) -> tuple[Rule, ...]:
    """Every rule of a run with the plugins of ``pm``: the backends' declared ones, then :data:`RULES`
    (without ``pm``: :data:`RULES` alone)."""
    return RULES if pm is None else backend_rules(pm.registry("training_backend")) + RULES


def check_compatibility(cfg: Any, pm: Any = None, **facts: Any) -> None:
    """Refuse the first rule of :func:`rules` that the config matches (with ``facts``: :data:`RUN_FACTS`
    by key, e.g. ``world_size=2``, and ``moe=False`` for ``model.moe``). ``pm``: the plugin manager whose
    registrations the rules read (without it, only the rules that read no registration apply)."""
    values = flat_values(cfg)
    if "world_size" in facts:
        values["world_size"] = facts["world_size"]
    if "moe" in facts:
        values["model.moe"] = facts["moe"]
    derive(values, pm)
    every = rules(pm)
    for rule in every if not facts else [r for r in every if r.at_start]:
        if rule.applies(values):
            raise ConfigError(rule.message(values))
