"""Stage 3 of a step: everything the loss needs beyond the samples (:class:`~rlite.rollout.TrainTargets`).

In order: pi_old (recomputed by the trainer, or the engine's log-probs in ``bypass`` mode), pi_ref,
the KL reward penalty, the loss mask (minus truncated samples), the mismatch corrections, the
critic's values, and the advantages. Corrections, advantages and the mismatch metrics are computed
on the *global* batch (gathered once from all ranks) and each rank keeps its rows, so estimators and
corrections that normalise over the batch give the same numbers at every world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlite.algorithms import AdvantageInput
from rlite.distributed import DataLayout, all_gather_objects
from rlite.kl_control import KLController, kl_reward_penalty, update_kl_controller
from rlite.mismatch import OLD_LOGPROB_MODES, compose_corrections, mismatch_metrics
from rlite.rollout import RolloutBatch, TrainTargets, pad_to_width
from rlite.stages.update import LossSpec, micro_batching, score_logprobs
from rlite.training.backend import CriticModel, ForwardSpec, ScoringModel, TrainingBackend


@dataclass
class TargetsSpec:
    """The algorithm's choices that shape the targets."""

    advantage: tuple  # (estimator, its config)
    old_logprob_mode: str
    minibatches: int
    epochs: int
    kl_in_reward: bool
    mask_truncated: bool
    corrections: list
    """Corrections applied here (those that need the current log-probs run in the loss instead)."""
    micro_batch_size: int
    reward_weights: tuple[float, ...] = ()
    """Weight of each reward function (``AdvantageInput.reward_weights``)."""


def prepare_training_targets(
    batch: RolloutBatch,
    spec: TargetsSpec,
    *,
    policy: TrainingBackend,
    reference: ScoringModel | None,
    critic: CriticModel | None,
    forward: ForwardSpec,
    loss: LossSpec,
    kl_controller: KLController,
    layout: DataLayout,
) -> dict[str, float]:
    """Fill ``batch.targets``; return the metrics made on the way (global over ranks). The mismatch
    metrics are among them when the trainer recomputed pi_old."""
    metrics: dict[str, float] = {}
    mode = OLD_LOGPROB_MODES[spec.old_logprob_mode]
    one_step_on_policy = spec.minibatches == 1 and spec.epochs == 1
    need_old = not one_step_on_policy or bool(spec.corrections) or spec.kl_in_reward
    old = recomputed = None
    if need_old or not mode.recomputes:
        recomputed = score_logprobs(policy, batch, forward, spec.minibatches, layout.group) if mode.recomputes else None
        old = mode.resolve(recomputed, batch.rollout_logprobs)
    ref = None if reference is None else score_logprobs(reference, batch, forward, spec.minibatches, layout.group)
    token_rewards = None
    if spec.kl_in_reward and ref is not None:
        kl = loss.kl_fn(old, ref).detach()
        token_rewards = kl_reward_penalty(kl, kl_controller.value, batch.response_mask)
        metrics["actor/reward_kl_penalty_coeff"] = kl_controller.value
        # verl's actor/reward_kl_penalty averages empty sequences in as 0; this one leaves them out
        metrics["actor/reward_kl"] = update_kl_controller(kl_controller, kl, batch.response_mask, layout.group)
    loss_mask = batch.response_mask.clone()
    if spec.mask_truncated:
        truncated = torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.bool)
        loss_mask[truncated] = 0.0
    old_values = None
    if critic is not None:
        old_values = critic.values(batch, micro_batching(forward, layout.group), forward.exact_layout, spec.minibatches,
                                   packed=forward.pack_sequences)

    # one collective: every rank's rows, so that batch statistics are global
    local = (batch.scores, batch.group_ids, batch.response_mask, token_rewards, old_values,
             old, batch.rollout_logprobs, loss_mask, batch.baseline_scores, batch.reward_components)
    parts = all_gather_objects(local, layout.group)
    width = max(p[2].shape[1] for p in parts)

    def cat(i: int) -> torch.Tensor | None:
        if parts[0][i] is None:
            return None
        if i == 9:  # [B, K] reward components: K is the same on every rank
            return torch.cat([p[i] for p in parts])
        return torch.cat([p[i] if p[i].dim() == 1 else pad_to_width(p[i], width) for p in parts])

    start = sum(len(p[0]) for p in parts[: layout.rank])
    rows = slice(start, start + len(batch))
    local_width = batch.response_mask.shape[1]

    def mine(x: torch.Tensor) -> torch.Tensor:
        return x[rows, :local_width]

    is_weights = None
    global_mask = cat(7)
    if spec.corrections:
        weights, global_mask, corr_metrics = compose_corrections(spec.corrections, cat(5), cat(6), global_mask)
        loss_mask = mine(global_mask)
        is_weights = None if weights is None else mine(weights)
        metrics.update(corr_metrics)
    estimator, estimator_cfg = spec.advantage
    scores = cat(0)
    advantages, returns = estimator(
        AdvantageInput(
            scores=scores, group_ids=cat(1), response_mask=cat(2), token_rewards=cat(3), values=cat(4),
            baseline_scores=cat(8), reward_components=cat(9),
            reward_weights=torch.tensor(spec.reward_weights, dtype=torch.float64) if spec.reward_weights else None,
        ),
        estimator_cfg,
    )
    if recomputed is not None:  # else the report measures it against the first training forward
        metrics.update(mismatch_metrics(cat(5), cat(6), cat(2)))
    response_mask = cat(2)
    metrics["advantage/mean"] = float((advantages * response_mask).sum() / response_mask.sum().clamp(min=1))
    metrics["reward/std"] = scores.std().item() if len(scores) > 1 else 0.0
    metrics["advantage/zero_variance_groups"] = zero_variance_fraction(cat(1), scores)
    batch.targets = TrainTargets(
        advantages=mine(advantages).float(),
        returns=mine(returns).float(),
        loss_mask=loss_mask,
        old_logprobs=old,
        ref_logprobs=ref,
        is_weights=is_weights,
        old_values=old_values,
    )
    return metrics


def zero_variance_fraction(group_ids: torch.Tensor, scores: torch.Tensor) -> float:
    """The fraction of groups whose rewards are all equal (their GRPO advantages are all zero)."""
    groups: dict[int, list[float]] = {}
    for gid, score in zip(group_ids.tolist(), scores.tolist()):
        groups.setdefault(gid, []).append(score)
    return sum(1 for s in groups.values() if max(s) == min(s)) / max(len(groups), 1)
