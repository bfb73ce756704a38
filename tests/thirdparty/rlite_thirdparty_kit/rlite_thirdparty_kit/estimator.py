"""``range_baseline``: a group baseline normalised by the group's range instead of its standard deviation.

For response i of the group G(i) of responses to the same prompt,

    A_i = scale * (R_i - mean_{j in G(i)} R_j) / (max_{j in G(i)} R_j - min_{j in G(i)} R_j + eps)

on every response token of i (0 on padding and on masked tokens); the returns equal the advantages. A group
whose rewards are all equal (a singleton included) gets 0. Computed in float64 and returned in the scores'
dtype (float32 for integer scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RangeBaselineConfig:
    scale: float = 1.0
    """Multiplier of the normalised advantage."""
    eps: float = 1e-6
    """Added to the group's range before dividing."""


def range_baseline(batch, cfg: RangeBaselineConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[B, T]`` of an ``rlite.api.AdvantageInput``, vectorised over groups."""
    scores = batch.scores.double()
    _, group = torch.unique(batch.group_ids, return_inverse=True)
    groups = int(group.max()) + 1 if len(group) else 0
    count = torch.zeros(groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(scores))
    mean = torch.zeros(groups, dtype=torch.float64).index_add_(0, group, scores) / count
    high = torch.full((groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, group, scores, "amax")
    low = torch.full((groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, group, scores, "amin")
    per_response = cfg.scale * (scores - mean[group]) / (high - low + cfg.eps)[group]
    dtype = batch.scores.dtype if batch.scores.is_floating_point() else torch.float32
    advantages = (per_response[:, None] * batch.response_mask.double()).to(dtype)
    return advantages, advantages.clone()


def range_baseline_reference(batch, cfg: RangeBaselineConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's formula as a plain float64 loop: what ``rlite audit`` and
    ``rlite.testing.conformance.check_estimator`` compare ``range_baseline`` with."""
    scores, groups = batch.scores.double().tolist(), batch.group_ids.tolist()
    per_response = []
    for score, group in zip(scores, groups):
        members = [s for s, g in zip(scores, groups) if g == group]
        mean = sum(members) / len(members)
        per_response.append(cfg.scale * (score - mean) / (max(members) - min(members) + cfg.eps))
    advantages = torch.tensor(per_response, dtype=torch.float64)[:, None] * batch.response_mask.double()
    return advantages, advantages.clone()
