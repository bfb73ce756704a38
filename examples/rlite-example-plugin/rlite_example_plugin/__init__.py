"""An example rlite plugin: one advantage estimator, one reward function, one lifecycle hook.

``median_baseline`` computes, for response i of a group G(i) of responses to the same prompt,

    A_i = scale * (R_i - median_{j in G(i)} R_j)

and puts A_i on every response token of i (zero on padding); the returns equal the advantages.
The median of an even-sized group is the mean of its two middle values. Against GRPO's mean
baseline, a median baseline is not pulled by a single outlier reward, and it does not divide by
the group's standard deviation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from rlite import hookimpl

calls: Counter[str] = Counter()
"""How many times each lifecycle hook of this plugin ran in this process."""


@dataclass
class MedianBaselineConfig:
    """Options of ``median_baseline`` (``algorithm.advantage.args``)."""

    scale: float = 1.0
    """Multiplier of R - median(group)."""


def median_baseline(batch, cfg: MedianBaselineConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages ``[B, T]`` of an :class:`rlite.algorithms.AdvantageInput` (see the module docstring)."""
    scores = batch.scores.double()  # medians in float64, returned in the scores' dtype (float32 for integers)
    baseline = torch.empty_like(scores)
    for group in torch.unique(batch.group_ids):
        members = batch.group_ids == group
        baseline[members] = torch.quantile(scores[members], 0.5)
    dtype = batch.scores.dtype if batch.scores.is_floating_point() else torch.float32
    advantages = ((cfg.scale * (scores - baseline)).unsqueeze(-1) * batch.response_mask.double()).to(dtype)
    return advantages, advantages.clone()


def median_baseline_reference(batch, cfg: MedianBaselineConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's formula again, as a plain float64 loop: what ``rlite audit`` and
    ``rlite.testing.conformance.check_estimator`` compare ``median_baseline`` with."""
    scores, groups = batch.scores.double().tolist(), batch.group_ids.tolist()
    per_response = []
    for score, group in zip(scores, groups):
        members = sorted(s for s, g in zip(scores, groups) if g == group)
        middle = len(members) // 2
        median = members[middle] if len(members) % 2 else (members[middle - 1] + members[middle]) / 2
        per_response.append(cfg.scale * (score - median))
    advantages = torch.tensor(per_response, dtype=torch.float64)[:, None] * batch.response_mask.double()
    return advantages, advantages.clone()


@dataclass
class ContainsAnswerConfig:
    """Options of ``contains_answer`` (``rewards[i].args``)."""

    weight: float = 1.0
    """Weight of this reward in the sum over ``rewards``."""
    ignore_case: bool = False
    """Compare lower-cased text."""


def contains_answer(completion: str, sample: dict, cfg: ContainsAnswerConfig) -> float:
    """1.0 when ``str(sample["answer"])`` occurs anywhere in the completion, else 0.0."""
    answer = str(sample["answer"])
    if cfg.ignore_case:
        completion, answer = completion.lower(), answer.lower()
    return 1.0 if answer in completion else 0.0


@hookimpl
def register_advantage_estimators(register):
    register("median_baseline", median_baseline, MedianBaselineConfig, reference=median_baseline_reference)


@hookimpl
def register_reward_functions(register):
    register("contains_answer", contains_answer, ContainsAnswerConfig)


@hookimpl
def on_metrics(step):  # a hook may take fewer arguments than its spec: on_metrics(step, metrics)
    calls["on_metrics"] += 1
