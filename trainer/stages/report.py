"""Stage 6 of a step: the metrics every rank agrees on, logged on rank 0.

Every logged value is global over the data-parallel ranks: the sums below are gathered once per
step (one collective over the data-parallel group); the batch statistics made in :mod:`rlite.stages.targets` come from the
gathered batch, and the update's metrics are reduced in :mod:`rlite.stages.update`.

With a speculative draft (``rollout.draft``), from the engines' :class:`SpeculationStats` of the
step's rollout summed over ranks (``docs/speculative.md``):

==================================== ===========================================================
``spec/acceptance_rate``             accepted / proposed draft tokens
``spec/mean_accepted_length``        accepted draft tokens per target forward (per sequence)
``spec/tokens_per_target_forward``   tokens emitted per target forward (accepted + the target's own)
``spec/proposed_per_target_forward`` draft tokens proposed per target forward
``spec/rollout_s``                   the engines' generation time (mean over ranks)
``spec/no_draft_estimate_s``         the engines' estimate of that time without a draft (mean)
``spec/estimated_speedup``           ``no_draft_estimate_s / rollout_s``
``spec/draft_time_fraction``         the share of generation time spent in the draft
==================================== ===========================================================

and from the draft's update, ``draft/loss``, ``draft/top1_agreement`` (how often the draft's most
likely token is the sampled one) and ``draft/grad_norm`` (:mod:`rlite.drafts`), with its time in
``time/draft``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import torch

from rlite.algorithms.mismatch import mismatch_metrics
from rlite.distributed import all_gather_objects
from rlite.engines.base import SpeculationStats
from rlite.metrics import Reported, merge_reported, reported_values
from rlite.perf import SequenceSums, perf_summary, sequence_sums
from rlite.reward_runner import is_count_stat
from rlite.rollout import ScoredBatch, pad_to_width

COUNTS = ("reward/failures", "reward/timeouts", "dynamic_sampling/dropped_groups")
"""Reward and sampling statistics that are counts (summed over ranks); the others are means over a
rank's samples, and every rank has the same number of samples, so their mean over ranks is global."""


class StepTokens(NamedTuple):
    """The global batch's token counts, for the ``perf/*`` metrics (:mod:`rlite.perf`)."""

    generated: float
    """Sampled response tokens (``response_mask``)."""
    sequences: SequenceSums
    """Sums over every sequence's real length (prompt + response, observations included): what a trainer pass computes."""


def step_metrics(
    batch: ScoredBatch, first_pass_logprobs: torch.Tensor, reward_stats: dict[str, float], *, measure_mismatch: bool,
    dp_group: Any = None, speculation: SpeculationStats | None = None, reported: Reported | None = None,
) -> tuple[dict[str, float], StepTokens]:
    """Reward and length metrics of the global batch, and with ``measure_mismatch`` (the trainer did
    not recompute pi_old) the mismatch between the first training forward and the engine, with
    ``speculation`` the speculative-decoding metrics, and what the components reported this step through
    their :class:`~rlite.metrics.MetricsSink` (``reported``, this rank's; reduced over ranks as each name
    asks); returns them and the global token counts."""
    mask = batch.response_mask
    lengths = sequence_sums(batch.prompt_mask.sum(-1) + batch.response_present.sum(-1))
    local = torch.tensor([
        batch.scores.sum().item(),
        batch.correct.float().sum().item(),
        mask.sum().item(),
        float(sum(r == "length" for r in batch.finish_reasons)),
        float(len(batch)),
        lengths.tokens,
        lengths.causal_pairs,
    ], dtype=torch.float64)
    mismatch_parts = (first_pass_logprobs, batch.rollout_logprobs, mask) if measure_mismatch else None
    parts = all_gather_objects((local, mismatch_parts, reward_stats, speculation, reported or {}), dp_group)
    reward_sum, correct, tokens, truncated, count, sequence_tokens, pairs = torch.stack([p[0] for p in parts]).sum(0).tolist()
    metrics = {
        "reward/mean": reward_sum / count,
        "reward/accuracy": correct / count,
        "response/length": tokens / count,
        "response/truncated": truncated / count,
    }
    if mismatch_parts is not None:
        width = max(p[1][2].shape[1] for p in parts)
        train, roll, m = (torch.cat([pad_to_width(p[1][i], width) for p in parts]) for i in range(3))
        metrics.update(mismatch_metrics(train, roll, m))
    for key in dict.fromkeys(key for p in parts for key in p[2]):  # a count may be missing on a rank
        values = [float(p[2].get(key, 0.0)) for p in parts]
        metrics[key] = sum(values) if key in COUNTS or is_count_stat(key) else sum(values) / len(values)
    if speculation is not None:
        metrics.update(speculation_metrics([p[3] for p in parts]))
    components = reported_values(merge_reported(p[4] for p in parts))
    clash = sorted(set(components) & set(metrics))
    if clash:
        raise ValueError(f"a component reported metrics that rlite logs itself: {clash}; report them under a prefix "
                         "of your own (docs/plugins.md, Reporting metrics)")
    metrics.update(components)
    return metrics, StepTokens(tokens, SequenceSums(sequence_tokens, pairs))


def speculation_metrics(per_rank: list[SpeculationStats]) -> dict[str, float]:
    """The ``spec/*`` metrics (module docstring) from every rank's stats; counts are summed, times
    averaged over the ranks that generated."""
    total = sum(per_rank, SpeculationStats())
    generating = max(sum(s.time_s > 0 for s in per_rank), 1)
    forwards = max(total.verifications, 1)
    return {
        "spec/acceptance_rate": total.accepted / max(total.proposed, 1),
        "spec/mean_accepted_length": total.accepted / forwards,
        "spec/tokens_per_target_forward": total.emitted / forwards,
        "spec/proposed_per_target_forward": total.proposed / forwards,
        "spec/rollout_s": total.time_s / generating,
        "spec/no_draft_estimate_s": total.no_draft_estimate_s / generating,
        "spec/estimated_speedup": total.no_draft_estimate_s / max(total.time_s, 1e-12),
        "spec/draft_time_fraction": total.draft_s / max(total.time_s, 1e-12),
    }


def summarize_metrics(metrics_file: Path, last: dict[str, float]) -> dict[str, float]:
    """Final reward and held-out accuracies, with the accuracy at the run's first evaluation; with a
    speculative draft its acceptance rate (first, final, mean) and estimated speed-up; the steps
    without a learning signal, if any."""
    from rlite.metrics import NO_SIGNAL_FRACTION, ZERO_VARIANCE_KEY, read_metrics

    rows = read_metrics(metrics_file) if metrics_file.is_file() else []
    trained = [r for r in rows if "reward/mean" in r] or [last]
    evals = [r for r in rows if "eval/greedy_accuracy" in r]
    out = {"final_reward": trained[-1].get("reward/mean", math.nan)}
    # every reward call that failed or timed out, in training steps and evaluations
    out["reward_failures"] = int(sum(r.get("reward/failures", 0) + r.get("eval/reward_failures", 0) for r in rows))
    out["reward_timeouts"] = int(sum(r.get("reward/timeouts", 0) + r.get("eval/reward_timeouts", 0) for r in rows))
    for mode in ("greedy", "sampled"):
        key = f"eval/{mode}_accuracy"
        if evals:
            first, final = evals[0][key], evals[-1][key]
            out[f"eval_{mode}_accuracy_first (step {evals[0]['step']})"] = first
            out[f"eval_{mode}_accuracy_final (step {evals[-1]['step']})"] = final
            out[f"eval_{mode}_accuracy_gain"] = final - first
    speculative = [r for r in trained if "spec/acceptance_rate" in r]
    if speculative:  # a draft was on: how much of what it proposed the policy kept, and what that bought
        first, final = speculative[0], speculative[-1]
        out[f"draft_acceptance_first (step {first['step']})"] = first["spec/acceptance_rate"]
        out[f"draft_acceptance_final (step {final['step']})"] = final["spec/acceptance_rate"]
        out["draft_acceptance_mean"] = sum(r["spec/acceptance_rate"] for r in speculative) / len(speculative)
        speedups = [r["spec/estimated_speedup"] for r in speculative if "spec/estimated_speedup" in r]
        if speedups:
            out["draft_estimated_speedup_mean"] = sum(speedups) / len(speedups)
    out.update(perf_summary(trained))  # MFU, model TFLOP/s, the update's tokens/s (steps after the first)
    # rows of metrics.jsonl, or only the last step's metrics (no "step") when the jsonl logger is off
    silent = [r for r in trained if r.get(ZERO_VARIANCE_KEY, 0.0) >= NO_SIGNAL_FRACTION]
    if silent:  # the steps that could not learn (the run warned about them as they happened)
        out["steps_without_learning_signal"] = (
            f"{len(silent)} of {len(trained)} (>= {NO_SIGNAL_FRACTION:.0%} of groups with equal rewards: "
            f"{ZERO_VARIANCE_KEY})"
        )
    return out
