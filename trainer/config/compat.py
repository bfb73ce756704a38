"""Which settings combine: the one list of pairs of settings that rlite refuses, and the check that applies it.

A :class:`Rule` names two :class:`Setting` s ("``parallelism.backend=megatron`` with
``parallelism.cpu_offload=true``"), why they do not combine and what to use instead. A run whose
settings match both sides of a rule stops with a :class:`~rlite.config.schema.ConfigError` (exit
status 2) naming both keys. Most rules read only the config and are checked when it loads
(:func:`check_compatibility` from :func:`rlite.config.load_config`); a few need a fact that is known
only once the run starts (its number of ranks, whether the model has Mixture-of-Experts layers) and
are checked there, by the same function given that fact.

Everything that combines is meant to run: ``tests/matrix`` runs an all-pairs covering set of the
options users combine (:mod:`rlite.matrix`), and ``docs/compatibility.md`` is generated from this list.
A setting that one backend or engine would silently ignore belongs here, refused, rather than ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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


MEGATRON = equals("parallelism.backend", "megatron")
ON_FSDP2 = "or use parallelism.backend=fsdp2, which implements it"
MULTI_TURN = Setting("rollout.multi_turn", bool, "a multi-turn rollout.workflow",
                     lambda v: f"rollout.workflow={v['rollout.workflow']} (multi-turn)",
                     example=("rollout.workflow=arithmetic_chain",), names=("rollout.workflow",))
OVERLAPS = Setting("rollout.overlaps", bool, "rollout.mode=one_step_off, or async with max_staleness > 0",
                   lambda v: f"rollout.mode={v['rollout.mode']}" + (
                       f" (rollout.max_staleness={v['rollout.max_staleness']})" if v["rollout.mode"] == "async" else ""),
                   example=("rollout.mode=one_step_off",), names=("rollout.mode",))
SHARES_WEIGHTS = Setting("rollout.engine_shares_weights", bool,
                         "the in-process transformers engine with rollout.engine.args.share_weights=true",
                         lambda v: "rollout.engine=transformers in process with rollout.engine.args.share_weights=true",
                         example=("rollout.engine.args.share_weights=true",), names=("rollout.engine.args.share_weights",))
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
                            "rollout.mode=one_step_off or async (max_staleness > 0) with the in-process engine",
                            lambda v: f"rollout.mode={v['rollout.mode']} with rollout.engine={v['rollout.engine']} in "
                                      "process", example=("rollout.mode=one_step_off",
                                                          "rollout.engine.args.share_weights=false"),
                            names=("rollout.mode", "rollout.engine.args.process"))
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
    Rule(MEGATRON, equals("parallelism.cpu_offload", True),
         "the megatron backend keeps parameters and gradients on the training device between uses, where FSDP2's "
         "CPUOffloadPolicy moves them to the host (megatron-core 0.16.1's optimizer CPU offload, HybridDeviceOptimizer, "
         "copies state over CUDA streams and comes only with megatron's distributed optimizer over its own DDP "
         "buffers, which this backend does not build; on a CPU the weights are in host memory anyway), so it would "
         "be silently ignored",
         "set parallelism.cpu_offload=false (training.optimizer_offload=disk moves AdamW's moments off the device "
         f"on a CPU), {ON_FSDP2}"),
    Rule(MEGATRON, equals("training.liger_fused_logprobs", True),
         "the megatron backend computes log-probs over its tensor-parallel vocabulary slices itself (liger's kernel "
         "would be silently ignored)",
         f"set training.liger_fused_logprobs=auto (off for this backend) or false, {ON_FSDP2}"),
    Rule(MEGATRON, equals("training.compile", True),
         "the megatron backend builds megatron-core's own modules and does not compile them (it would be silently "
         "ignored)", f"set training.compile=false, {ON_FSDP2}"),
    Rule(equals("training.compile", True), equals("training.share_prompt_prefix", True),
         "the shared-prompt forward hands each decoder block a KV cache indexed by the block's layer number, which "
         "torch.compile specialises per layer and per pass, past its recompile limit (the blocks would run eager)",
         "set training.share_prompt_prefix=false with training.compile=true (each prompt then runs once per sample), "
         "or training.compile=false"),
    Rule(MEGATRON, equals("model.lora.enabled", True), "the megatron backend trains full weights",
         "set model.lora.enabled=false, or use parallelism.backend=fsdp2 for LoRA"),
    Rule(MEGATRON, equals("algorithm.critic.enabled", True), "the megatron backend has no critic yet",
         "use an estimator without a critic (algorithm.advantage=grpo), or parallelism.backend=fsdp2 for PPO with GAE"),
    Rule(MEGATRON, equals("training.pack_sequences", True),
         "the megatron backend does not run packed (THD) sequences yet (it would pad them)",
         f"set training.pack_sequences=false (training.max_tokens_per_micro_batch works), {ON_FSDP2}"),
    Rule(equals("training.pack_sequences", True), TRUE_ON_POLICY,
         "true on-policy mode scores the engine's own padded layout so that the log-probs are bitwise the engine's, "
         "and a packed forward computes them in another layout", "set one of them to false"),
    Rule(MEGATRON, TRUE_ON_POLICY,
         "true on-policy sampling makes the engine's log-probs equal the trainer's bitwise by running the "
         "trainer's own Hugging Face forward, and megatron's GPTModel computes in another order (measured on a tiny "
         "model: 75-91% of sampled tokens bitwise equal)",
         "set rollout.true_on_policy=false (algorithm.old_logprob_mode=decoupled keeps the first ratio exactly 1), "
         "or use parallelism.backend=fsdp2"),
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
         "the in-process engine samples in a thread of the trainer's process, seeding torch's global random "
         "generator for each call and restoring it after, and LoRA dropout in the training thread draws from that "
         "same generator: its masks would repeat and the samples would depend on the threads' timing",
         "set model.lora.dropout=0 (usual in RL), rollout.engine.args.process=true (the engine in its own process), "
         "or rollout.mode=sync"),
    Rule(OVERLAPS, SHARES_WEIGHTS,
         "the engine samples while the trainer updates, so it needs its own copy of the weights",
         "leave rollout.engine.args.share_weights out (its default keeps the engine's own copy in these modes), "
         "set it false, or rollout.mode=sync"),
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


def derive(values: dict[str, Any], single_turn: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """``values`` plus the few keys that rules read and that are functions of several settings."""
    workflow = values["rollout.workflow"]
    values["rollout.multi_turn"] = not (single_turn(workflow) if single_turn else workflow == "single_turn")
    mode = values["rollout.mode"]
    values["rollout.overlaps"] = mode == "one_step_off" or (mode == "async" and values["rollout.max_staleness"] > 0)
    in_process = values["rollout.engine"] == "transformers" and not values.get("rollout.engine.args.process", False)
    # share_weights' default (None) chooses the engine's own copy when the rollouts overlap the update
    values["rollout.engine_shares_weights"] = in_process and values.get("rollout.engine.args.share_weights") is True
    values["rollout.samples_in_thread"] = in_process and values["rollout.overlaps"]
    values["model.lora.dropout_active"] = values["model.lora.enabled"] and values["model.lora.dropout"] > 0
    if "model.moe" in values:
        records = values["algorithm.routing_replay"] == "rollout" or values["algorithm.routing_metrics"]
        values["model.records_routing"] = values["model.moe"] and records
    return values


def check_compatibility(cfg: Any, pm: Any = None, **facts: Any) -> None:
    """Refuse the first rule of :data:`RULES` that the config matches (with ``facts``: :data:`RUN_FACTS`
    by key, e.g. ``world_size=2``, and ``moe=False`` for ``model.moe``). ``pm``: the plugin manager whose
    workflow registry says which workflows are single-turn (without it: only ``single_turn``)."""
    single_turn = None
    if pm is not None:
        workflows = pm.registry("rollout_workflow")
        single_turn = lambda name: bool(workflows.get(name).metadata.get("single_turn"))  # noqa: E731
    values = flat_values(cfg)
    if "world_size" in facts:
        values["world_size"] = facts["world_size"]
    if "moe" in facts:
        values["model.moe"] = facts["moe"]
    derive(values, single_turn)
    for rule in RULES if not facts else [r for r in RULES if r.at_start]:
        if rule.applies(values):
            raise ConfigError(rule.message(values))
