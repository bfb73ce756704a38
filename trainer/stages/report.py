"""Stage 6 of a step: the metrics every rank agrees on, logged on rank 0.

Every logged value is global over the data-parallel ranks: the sums below are gathered once per
step (one collective over the data-parallel group); the batch statistics made in :mod:`rlite.stages.targets` come from the
gathered batch, and the update's metrics are reduced in :mod:`rlite.stages.update`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from rlite.distributed import all_gather_objects
from rlite.mismatch import mismatch_metrics
from rlite.rollout import RolloutBatch, pad_to_width

COUNTS = ("reward/failures", "reward/timeouts", "dynamic_sampling/dropped_groups")
"""Reward and sampling statistics that are counts (summed over ranks); the others are means over a
rank's samples, and every rank has the same number of samples, so their mean over ranks is global."""


def step_metrics(
    batch: RolloutBatch, first_pass_logprobs: torch.Tensor, reward_stats: dict[str, float], *, measure_mismatch: bool,
    dp_group: Any = None,
) -> tuple[dict[str, float], float]:
    """Reward and length metrics of the global batch, and with ``measure_mismatch`` (the trainer did
    not recompute pi_old) the mismatch between the first training forward and the engine; returns
    them and the global number of generated tokens."""
    mask = batch.response_mask
    local = torch.tensor([
        batch.scores.sum().item(),
        (batch.scores > 0).float().sum().item(),
        mask.sum().item(),
        float(sum(r == "length" for r in batch.finish_reasons)),
        float(len(batch)),
    ], dtype=torch.float64)
    mismatch_parts = (first_pass_logprobs, batch.rollout_logprobs, mask) if measure_mismatch else None
    parts = all_gather_objects((local, mismatch_parts, reward_stats), dp_group)
    reward_sum, correct, tokens, truncated, count = torch.stack([p[0] for p in parts]).sum(0).tolist()
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
    for key in reward_stats:
        values = [float(p[2][key]) for p in parts]
        metrics[key] = sum(values) if key in COUNTS else sum(values) / len(values)
    return metrics, tokens


def summarize_metrics(metrics_file: Path, last: dict[str, float]) -> dict[str, float]:
    """Final reward and held-out accuracies, with the accuracy at the run's first evaluation."""
    from rlite.metrics import read_metrics

    rows = read_metrics(metrics_file) if metrics_file.is_file() else []
    trained = [r for r in rows if "reward/mean" in r] or [last]
    evals = [r for r in rows if "eval/greedy_accuracy" in r]
    out = {"final_reward": trained[-1].get("reward/mean", math.nan)}
    for mode in ("greedy", "sampled"):
        key = f"eval/{mode}_accuracy"
        if evals:
            first, final = evals[0][key], evals[-1][key]
            out[f"eval_{mode}_accuracy_first (step {evals[0]['step']})"] = first
            out[f"eval_{mode}_accuracy_final (step {evals[-1]['step']})"] = final
            out[f"eval_{mode}_accuracy_gain"] = final - first
    return out
