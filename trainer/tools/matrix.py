"""The combination matrix: the options users combine, an all-pairs covering set of runs over them, and
the run of one case with its invariants checked (``tests/matrix``).

Which pairs are refused comes from the rules alone (:func:`rlite.config.compat.rules` with the built-in plugins
and megatron's: rlite's own and those the plugins' registrations declare): :func:`refusing_rule`
evaluates them on the config values a partial assignment of options decides. :func:`pairwise_cases`
is a small greedy all-pairs generator (deterministic): every pair of option values that no rule
refuses appears in at least one case, and no case matches a rule. ``python -m rlite.tools.matrix``
writes ``docs/compatibility.md`` from the same rules and options.

Each case runs 2 steps on tiny models (:func:`run_case`: in this process at world size 1, two spawned
gloo ranks at world size 2) and must keep three invariants: the first on-policy ratio is exactly 1
(every policy-loss call comes before its step's one optimizer step here: one mini-batch, one epoch, one
micro-batch or, under a token budget, a few; so ``lp - old`` is 0 on every token of every call), every weight sync delivers the step as the engine's version and the
bytes the trainer's weights produce (SHA-256, :class:`rlite.tools.audit.Probe`), and every logged metric is
finite. With true on-policy sampling in sync mode the engine's log-probs equal the trainer's bitwise,
and a draft, routing replay, the critic, KL and dynamic sampling each show in their metrics (:data:`EFFECTS`).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlite.config.compat import RUN_FACTS, Rule, derive, flat_values, rules
from rlite.config.schema import _SKIP_CHECKS, RunConfig

# --------------------------------------------------------------------------------------------------
# the options
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Value:
    """One value of an option: the config values it sets (flat keys, in override order; ``{model}``,
    ``{moe_model}`` and ``{draft_model}`` stand for the tiny models' folders) and run facts."""

    name: str
    sets: Mapping[str, Any] = field(default_factory=dict)
    long: bool = False
    """A case with this value takes 15-60 s on two CPU cores (two ranks, megatron), against 1-10 s."""

    def overrides(self, paths: Mapping[str, str]) -> list[str]:
        return [f"{key}={str(value).format(**paths) if isinstance(value, str) else _yaml(value)}"
                for key, value in self.sets.items() if key not in RUN_FACTS]  # fmt: skip


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Option:
    """A dimension of the matrix; its first value is the default."""

    name: str
    values: tuple[Value, ...]
    derived: tuple[str, ...] = ()
    """Derived keys (:func:`rlite.config.compat.derive`) that this option alone decides."""

    @property
    def keys(self) -> set[str]:
        return {key for value in self.values for key in value.sets} | set(self.derived)


MOE = {"model.path": "{moe_model}", "model.moe": True}
OPTIONS: tuple[Option, ...] = (
    Option("backend", (Value("fsdp2", {"parallelism.backend": "fsdp2"}),
                       Value("megatron", {"parallelism.backend": "megatron"}, long=True))),
    Option("engine", (Value("in_process", {"rollout.engine.args.process": False, "rollout.engine.args.share_weights": True}),
                      Value("in_process_copy", {"rollout.engine.args.process": False,
                                                "rollout.engine.args.share_weights": False}),
                      Value("process", {"rollout.engine.args.process": True, "rollout.engine.args.share_weights": True})),
           derived=("rollout.engine_shares_weights",)),
    Option("mode", (Value("sync", {"rollout.mode": "sync", "rollout.partial_segment_tokens": 0}),
                    Value("one_step_off", {"rollout.mode": "one_step_off", "rollout.partial_segment_tokens": 0}),
                    Value("async", {"rollout.mode": "async", "rollout.partial_segment_tokens": 0}),
                    Value("async_partial", {"rollout.mode": "async", "rollout.partial_segment_tokens": 2})),
           derived=("rollout.overlaps",)),
    Option("workflow", (Value("single_turn", {"rollout.workflow": "single_turn"}),
                        Value("multi_turn", {"rollout.workflow": "arithmetic_chain", "rollout.workflow.args.steps": 2})),
           derived=("rollout.multi_turn",)),
    Option("draft", (Value("none", {"rollout.draft": "none"}),
                     Value("draft_model", {"rollout.draft": "draft_model", "rollout.draft.args.path": "{draft_model}"}),
                     Value("ngram", {"rollout.draft": "ngram"}))),
    Option("lora", (Value("off", {"model.lora.enabled": False}), Value("on", {"model.lora.enabled": True}))),
    Option("model", (Value("dense", {"model.moe": False, "algorithm.routing_replay": "none",
                                     "algorithm.routing_metrics": True}),
                     Value("moe", {**MOE, "algorithm.routing_replay": "none", "algorithm.routing_metrics": False}),
                     Value("moe_replay", {**MOE, "algorithm.routing_replay": "rollout",
                                          "algorithm.routing_metrics": True})),
           derived=("model.records_routing",)),
    Option("quantization", (Value("none", {"rollout.quantization": "none"}),
                            Value("fp8_blockwise", {"rollout.quantization": "fp8_blockwise"}))),
    Option("true_on_policy", (Value("off", {"rollout.true_on_policy": False}),
                              Value("on", {"rollout.true_on_policy": True}))),
    Option("critic", (Value("off", {"algorithm.advantage": "grpo", "algorithm.critic.enabled": False}),
                      Value("gae", {"algorithm.advantage": "gae", "algorithm.critic.enabled": True}))),
    Option("kl", (Value("none", {"algorithm.kl.coef": 0.0, "algorithm.kl.in_reward": False}),
                  Value("in_loss", {"algorithm.kl.coef": 0.01, "algorithm.kl.in_reward": False}),
                  Value("in_reward", {"algorithm.kl.coef": 0.01, "algorithm.kl.in_reward": True}))),
    Option("dynamic_sampling", (Value("off", {"algorithm.dynamic_sampling": False}),
                                Value("on", {"algorithm.dynamic_sampling": True}))),
    Option("batching", (Value("padded", {"training.pack_sequences": False, "training.max_tokens_per_micro_batch": 0}),
                        Value("packed_budget", {"training.pack_sequences": True,
                                                "training.max_tokens_per_micro_batch": 256}))),
    Option("world_size", (Value("1", {"world_size": 1}), Value("2", {"world_size": 2}, long=True))),
)

Case = dict[str, str]
"""Option name -> value name (a partial assignment while a case is being built)."""


def _value(option: str, name: str) -> Value:
    return next(v for o in OPTIONS if o.name == option for v in o.values if v.name == name)


def _base_values() -> dict[str, Any]:
    token = _SKIP_CHECKS.set(True)  # the schema's defaults, without a model or data to check
    try:
        return flat_values(RunConfig())
    finally:
        _SKIP_CHECKS.reset(token)


BASE = _base_values()


def refusing_rules(case: Case) -> list[Rule]:
    """The rules that refuse ``case``, reading only the keys its options decide (a key that an option
    not in ``case`` decides is unknown, and a rule reading it does not apply yet)."""
    values = dict(BASE)
    for option, name in case.items():
        values.update(_value(option, name).sets)
    derive(values, matrix_plugins())
    undecided = set().union(*(o.keys for o in OPTIONS if o.name not in case))
    known = {k: v for k, v in values.items() if k not in undecided}
    return [rule for rule in matrix_rules() if rule.applies(known)]


@functools.cache
def matrix_rules() -> tuple[Rule, ...]:
    """The rules of a run with the matrix's plugins (the built-ins and megatron), built once so that each
    rule is one object (the docs number them by identity)."""
    return rules(matrix_plugins())


def refusing_rule(case: Case) -> Rule | None:
    """The first rule that refuses ``case`` (the one a run reports), or None."""
    return next(iter(refusing_rules(case)), None)


# --------------------------------------------------------------------------------------------------
# all pairs
# --------------------------------------------------------------------------------------------------


def allowed_pairs() -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """Every pair of values of two options that no rule refuses, in option order."""
    pairs = []
    for a, b in itertools.combinations(OPTIONS, 2):
        for va, vb in itertools.product(a.values, b.values):
            if refusing_rule({a.name: va.name, b.name: vb.name}) is None:
                pairs.append(((a.name, va.name), (b.name, vb.name)))
    return pairs


def refused_pairs() -> list[tuple[tuple[str, str], tuple[str, str], Rule]]:
    out = []
    for a, b in itertools.combinations(OPTIONS, 2):
        for va, vb in itertools.product(a.values, b.values):
            rule = refusing_rule({a.name: va.name, b.name: vb.name})
            if rule is not None:
                out.append(((a.name, va.name), (b.name, vb.name), rule))
    return out


def pairwise_cases() -> list[Case]:
    """A covering set: each case starts from the first pair not yet covered, then gives every other
    option, in order, the value that covers the most new pairs without a rule refusing the case
    (ties: the earlier value, so defaults fill what does not matter)."""
    uncovered = set(allowed_pairs())
    order = [(a, b) for a, b in allowed_pairs()]
    cases: list[Case] = []
    while uncovered:
        (oa, va), (ob, vb) = next(p for p in order if p in uncovered)
        case: Case = {oa: va, ob: vb}
        for option in OPTIONS:
            if option.name in case:
                continue
            best, gain = None, -1
            for value in option.values:
                trial = {**case, option.name: value.name}
                if refusing_rule(trial) is not None:
                    continue
                new = sum(1 for other, chosen in case.items() if _pair((option.name, value.name), (other, chosen)) in uncovered)
                if new > gain:
                    best, gain = value.name, new
            if best is None:
                raise RuntimeError(f"no value of {option.name} combines with {case}: the rules leave a dead end")
            case[option.name] = best
        case = {o.name: case[o.name] for o in OPTIONS}
        covered = {_pair(x, y) for x, y in itertools.combinations(case.items(), 2)}
        uncovered -= covered
        cases.append(case)
    return cases


def _pair(x: tuple[str, str], y: tuple[str, str]) -> tuple[tuple[str, str], tuple[str, str]]:
    names = [o.name for o in OPTIONS]
    return (x, y) if names.index(x[0]) < names.index(y[0]) else (y, x)


def refusal_cases() -> list[tuple[Case, Rule]]:
    """For every rule that refuses a pair of matrix values: its first such pair, the other options at
    the first value that brings no other rule."""
    seen, out = set(), []
    for (oa, va), (ob, vb), rule in refused_pairs():
        if id(rule) in seen:
            continue
        case: Case = {oa: va, ob: vb}
        for option in OPTIONS:
            if option.name not in case:
                case[option.name] = next((v.name for v in option.values
                                          if refusing_rules({**case, option.name: v.name}) == [rule]),
                                         option.values[0].name)  # fmt: skip
        if refusing_rules(case) == [rule]:
            seen.add(id(rule))
            out.append(({o.name: case[o.name] for o in OPTIONS}, rule))
    return out


def case_overrides(case: Case, paths: Mapping[str, str]) -> list[str]:
    """The config overrides of a case (on top of :func:`rlite.testing.tiny_config`)."""
    out: list[str] = []
    for option in OPTIONS:
        out += _value(option.name, case[option.name]).overrides(paths)
    return out


def long_case(case: Case) -> bool:
    """A case with a long value (two spawned ranks, the megatron backend)."""
    return any(_value(option.name, case[option.name]).long for option in OPTIONS)


def case_id(case: Case) -> str:
    """The case's non-default values (``default`` when there are none)."""
    parts = [f"{o.name}={case[o.name]}" for o in OPTIONS if case[o.name] != o.values[0].name]
    return ",".join(parts) or "default"


# --------------------------------------------------------------------------------------------------
# the docs table
# --------------------------------------------------------------------------------------------------


def compatibility_markdown() -> str:
    """``docs/compatibility.md``: the rules, then which option values combine (from the same rules)."""
    lines = [
        "# What combines with what",
        "",
        "Generated by `python -m rlite.tools.matrix > docs/compatibility.md` from the rules in",
        "`trainer/config/compat.py`, those the plugins declare (a backend's `unsupported` features, an engine's",
        "capabilities: [plugins.md](plugins.md#capabilities)) and the options in `trainer/tools/matrix.py`; a test",
        "checks this file equals the output. Every pair below that is not refused runs: `tests/matrix` runs an all-pairs covering set of",
        f"{len(pairwise_cases())} runs (2 steps each, tiny models) checking that the first on-policy ratio is",
        "exactly 1, every weight sync delivers the right version and bytes, and every metric is finite.",
        "A refused pair stops the run with exit status 2 and a message naming both keys.",
        "",
        "## Refused pairs",
        "",
        "| setting | with | why | instead | checked |",
        "|---|---|---|---|---|",
    ]
    every = matrix_rules()
    for rule in every:
        when = "when the run starts" if rule.at_start else "when the config loads"
        lines.append(f"| `{rule.a.shown}` | `{rule.b.shown}` | {rule.why} | {rule.instead} | {when} |")
    lines += ["", "## Options of the matrix", "", "| option | values (first: default) | config |", "|---|---|---|"]
    for option in OPTIONS:
        keys = sorted({k for v in option.values for k in v.sets})
        lines.append(f"| {option.name} | {', '.join(v.name for v in option.values)} | "
                     f"{', '.join(f'`{k}`' for k in keys)} |")  # fmt: skip
    lines += ["", "## Pairs of option values", "",
              "Each cell: `ok` runs; otherwise the refused pair's rule, by its number in the table above.", ""]
    columns = [(o.name, v.name) for o in OPTIONS for v in o.values]
    number = {id(rule): i + 1 for i, rule in enumerate(every)}
    lines.append("| | " + " | ".join(f"{o}={v}" for o, v in columns) + " |")
    lines.append("|---" * (len(columns) + 1) + "|")
    for row in columns:
        cells = []
        for col in columns:
            if row[0] == col[0]:
                cells.append("")
                continue
            rule = refusing_rule(dict([row, col]))
            cells.append("ok" if rule is None else f"#{number[id(rule)]}")
        lines.append(f"| **{row[0]}={row[1]}** | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# running a case
# --------------------------------------------------------------------------------------------------


@functools.cache
def matrix_plugins():
    """Built-in plugins plus the megatron backend through its entry point, whatever the environment says
    about autoloading (the matrix has a megatron option); built once per process."""
    from rlite.plugin_manager import build_plugin_manager, load_entry_point_plugins

    pm = build_plugin_manager(autoload=False)
    load_entry_point_plugins(pm, only=["megatron"])
    return pm


def run_case(rank: int, world_size: int, init_file: str, model_dir: str, run_dir: str, out_dir: str,
             overrides: Sequence[str], hang_dump_s: float = 300.0) -> None:  # fmt: skip
    """Run one case (2 steps) on this rank and write what the invariants need to
    ``out_dir/rank<r>.json``: the metric rows (rank 0), each policy-loss call's max |lp - old|, and
    every sync's (step, engine version, digests equal)."""
    import torch
    import torch.distributed as dist

    from rlite.testing import tiny_config
    from rlite.tools.audit import replica_run

    torch.set_num_threads(1)
    if world_size > 1:
        import faulthandler

        faulthandler.enable(all_threads=True)  # a rank that dies of a signal (heap corruption) says where
        faulthandler.dump_traceback_later(hang_dump_s, exit=False)  # a hung rank says where it waits
        os.environ["LOCAL_RANK"] = str(rank)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        pm = matrix_plugins()
        cfg = tiny_config(model_dir, run_dir, *overrides, pm=pm)
        probe = every_call_probe()
        rows = replica_run(cfg, pm, probe)
        if world_size > 1:
            dist.barrier()
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
    record = {"rows": rows if rank == 0 else [], "ratio_gaps": probe.ratio_gaps, "syncs": probe.syncs}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def every_call_probe():
    """A :class:`rlite.tools.audit.Probe` that records every policy-loss call (each comes before its step's only
    optimizer step here)."""
    from rlite.tools.audit import Probe

    class EveryCallProbe(Probe):
        def instrument(self, run) -> None:
            super().instrument(run)
            recording = run.policy.loss.policy_loss

            def every_call(*args):
                self.first_call = True
                return recording(*args)

            run.policy.loss.policy_loss = every_call

    return EveryCallProbe()


EFFECTS: dict[tuple[str, str], tuple[str, str]] = {
    ("draft", "draft_model"): ("spec/proposed_per_target_forward", "positive"),
    ("draft", "ngram"): ("spec/proposed_per_target_forward", "present"),  # prompt lookup may find nothing
    ("model", "moe_replay"): ("routing/agreement_with_replay", "one"),
    ("critic", "gae"): ("critic/vf_loss", "present"),
    ("kl", "in_loss"): ("actor/kl_loss", "present"),
    ("kl", "in_reward"): ("actor/reward_kl", "present"),
    ("dynamic_sampling", "on"): ("dynamic_sampling/rounds", "present"),
}
"""A metric that shows an option value took effect (not silently ignored), and what every step must log."""


def invariant_failures(case: Case, records: Sequence[Mapping[str, Any]], steps: int) -> list[str]:
    """What a finished case broke (empty: nothing)."""
    failures = []
    rows = [r for r in records[0]["rows"] if "reward/mean" in r]
    if len(rows) != steps:
        failures.append(f"{len(rows)} training rows logged, expected {steps}")
    for rank, record in enumerate(records):
        gaps = record["ratio_gaps"]
        if len(gaps) < steps or any(g != 0.0 for g in gaps):  # a token budget may cut a step into several
            failures.append(f"rank {rank}: first on-policy ratio not exactly 1: max |lp - old| per step {gaps}")
        syncs = record["syncs"]
        if [s[0] for s in syncs] != list(range(1, steps + 1)) or any(s[1] != s[0] or not s[2] for s in syncs):
            failures.append(f"rank {rank}: weight syncs (step, engine version, sha256 equal): {syncs}")
    for row in rows:
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            failures.append(f"step {row.get('step')}: non-finite metrics {bad}")
    for (option, value), (metric, expect) in EFFECTS.items():
        if case[option] != value:
            continue
        seen = [r.get(metric) for r in rows]
        ok = {"present": all(v is not None for v in seen), "one": all(v == 1.0 for v in seen),
              "positive": all(v is not None for v in seen) and any(v > 0 for v in seen)}[expect]  # fmt: skip
        if not ok:
            failures.append(f"{option}={value} shows no effect: {metric} per step {seen} (expected {expect})")
    if case["true_on_policy"] == "on" and case["mode"] == "sync":
        fractions = [r.get("mismatch/bitwise_equal_fraction") for r in rows]
        if any(f != 1.0 for f in fractions):
            failures.append(f"true on-policy: bitwise-equal fraction per step {fractions}")
    return failures


if __name__ == "__main__":
    print(compatibility_markdown(), end="")
