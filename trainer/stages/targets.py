"""Stage 3 of a step: everything the loss needs beyond the samples (:class:`~rlite.rollout.TrainTargets`,
returned in :class:`PreparedTargets`; the run's component is :class:`Targets`).

In order: pi_old (recomputed by the trainer, or the engine's log-probs in ``bypass`` mode), pi_ref,
the KL reward penalty, the loss mask (minus truncated samples), the mismatch corrections, the
critic's values, and the advantages. Corrections, advantages and the mismatch metrics are computed
on the *global* batch (gathered once from all ranks) and each rank keeps its rows, so estimators and
corrections that normalise over the batch give the same numbers at every world size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from rlite.algorithms import AdvantageInput
from rlite.algorithms.mismatch import OLD_LOGPROB_MODES, compose_corrections, mismatch_metrics
from rlite.distributed import DataLayout, all_gather_objects
from rlite.rollout import ScoredBatch, TrainTargets, pad_to_width
from rlite.stages.kl_control import KLController, kl_reward_penalty, update_kl_controller
from rlite.stages.minibatches import score_logprobs, score_values
from rlite.stages.routing import RoutingSetup, measure_routing
from rlite.training.backend import CriticModel, ForwardSpec, ScoringModel, TrainingBackend


@dataclass(frozen=True)
class TargetsSpec:
    """The algorithm's choices that shape the targets (settled when the run is built)."""

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


@dataclass(frozen=True)
class PreparedTargets:
    """Stage 3's product (:meth:`Targets.prepare`), which the update (stage 4) trains with."""

    targets: TrainTargets
    """This rank's rows: advantages, returns, the loss mask and the log-probs and values of the loss."""
    metrics: dict[str, float]
    """Made on the way, global over ranks."""
    mismatch_measured: bool
    """The trainer recomputed pi_old, so ``metrics`` holds the mismatch metrics; else the step's report
    measures the mismatch against the first training forward."""


TOKEN = {"token": True}
"""Field metadata of a ``[B, T]`` column (padded to the widest rank's T when gathered)."""


@dataclass
class RankColumns:
    """The columns the batch statistics need, one row per sample: this rank's rows, or (gathered) every
    rank's in rank order. Optional columns are None on every rank alike."""

    scores: torch.Tensor
    group_ids: torch.Tensor
    response_mask: torch.Tensor = field(metadata=TOKEN)
    token_rewards: torch.Tensor | None = field(metadata=TOKEN)
    old_values: torch.Tensor | None = field(metadata=TOKEN)
    old_logprobs: torch.Tensor | None = field(metadata=TOKEN)
    rollout_logprobs: torch.Tensor | None = field(metadata=TOKEN)
    loss_mask: torch.Tensor = field(metadata=TOKEN)
    baseline_scores: torch.Tensor | None
    reward_components: torch.Tensor | None
    """``[B, K]``, K reward functions (the same K on every rank)."""


@dataclass
class GatheredColumns:
    columns: RankColumns
    """Every rank's rows, concatenated in rank order."""
    rank_sizes: list[int]
    """Each rank's number of rows (where a rank's rows start)."""


def gather_columns(local: RankColumns, layout: DataLayout) -> GatheredColumns:
    """Every rank's :class:`RankColumns` in one collective, concatenated column by column."""
    parts: list[RankColumns] = all_gather_objects(local, layout.group)
    width = max(p.response_mask.shape[1] for p in parts)
    joined = {}
    for f in fields(RankColumns):
        values = [getattr(p, f.name) for p in parts]
        if values[0] is None:
            joined[f.name] = None
        elif f.metadata.get("token"):
            joined[f.name] = torch.cat([pad_to_width(v, width) for v in values])
        else:
            joined[f.name] = torch.cat(values)
    return GatheredColumns(RankColumns(**joined), [len(p.scores) for p in parts])


class Targets:
    """Stage 3 as a run's component: the algorithm's choices (:class:`TargetsSpec`), the models that score a
    batch (the policy for pi_old, its reference, PPO's critic) with the forward spec they train with, the KL
    estimator and controller (its coefficient adapts during the run: the state this component owns), and the
    MoE routing measured on the batch. Built once by :func:`rlite.run.build.build_targets`."""

    def __init__(self, spec: TargetsSpec, *, policy: TrainingBackend, reference: ScoringModel | None,
                 critic: CriticModel | None, forward: ForwardSpec, kl_fn: Callable, kl_controller: KLController,
                 layout: DataLayout, routing: RoutingSetup | None = None) -> None:  # fmt: skip
        self.spec, self.policy, self.reference, self.critic = spec, policy, reference, critic
        self.forward, self.kl_fn, self.layout, self.routing = forward, kl_fn, layout, routing
        self.kl_controller = kl_controller

    def prepare(self, batch: ScoredBatch) -> PreparedTargets:
        """The batch's :class:`PreparedTargets` (:func:`prepare_training_targets`); for an MoE policy whose
        routing is measured, its agreement with and without replay added to the metrics."""
        prepared = prepare_training_targets(
            batch, self.spec, policy=self.policy, reference=self.reference, critic=self.critic, forward=self.forward,
            kl_fn=self.kl_fn, kl_controller=self.kl_controller, layout=self.layout,
        )
        if self.routing is not None and self.routing.metrics:
            prepared.metrics.update(measure_routing(self.policy, batch, self.forward, self.routing,
                                                    minibatches=self.spec.minibatches, layout=self.layout))
        return prepared

    def state_dict(self) -> dict:
        """What a checkpoint keeps of it: the KL controller's state."""
        return self.kl_controller.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.kl_controller.load_state_dict(state)


def prepare_training_targets(
    batch: ScoredBatch,
    spec: TargetsSpec,
    *,
    policy: TrainingBackend,
    reference: ScoringModel | None,
    critic: CriticModel | None,
    forward: ForwardSpec,
    kl_fn: Callable,
    kl_controller: KLController,
    layout: DataLayout,
) -> PreparedTargets:
    """The batch's :class:`~rlite.rollout.TrainTargets` and the metrics made on the way (global over ranks),
    which hold the mismatch metrics when the trainer recomputed pi_old (``PreparedTargets.mismatch_measured``):
    this rank's columns (:func:`rank_columns`), then the batch statistics over every rank's
    (:func:`global_targets`)."""
    metrics: dict[str, float] = {}
    local, scored = rank_columns(batch, spec, policy=policy, reference=reference, critic=critic, forward=forward,
                                 kl_fn=kl_fn, kl_controller=kl_controller, layout=layout, metrics=metrics)
    # one collective: every rank's rows, so that batch statistics are global
    everyone = gather_columns(local, layout)
    start = sum(everyone.rank_sizes[: layout.rank])
    targets = global_targets(everyone, slice(start, start + len(batch)), local, scored, spec, metrics)
    return PreparedTargets(targets, metrics, mismatch_measured=scored.recomputed is not None)


@dataclass(frozen=True)
class ModelScores:
    """What the models said about this rank's batch (no gradient)."""

    old: torch.Tensor | None
    """pi_old of the loss (``None``: the first training forward's)."""
    recomputed: torch.Tensor | None
    """The trainer's log-probs, when it recomputed pi_old."""
    ref: torch.Tensor | None
    """pi_ref (a KL term)."""
    old_values: torch.Tensor | None
    """The critic's values before the update."""


def rank_columns(
    batch: ScoredBatch, spec: TargetsSpec, *, policy: TrainingBackend, reference: ScoringModel | None,
    critic: CriticModel | None, forward: ForwardSpec, kl_fn: Callable, kl_controller: KLController,
    layout: DataLayout, metrics: dict[str, float],
) -> tuple[RankColumns, ModelScores]:
    """This rank's columns of the batch statistics: pi_old (recomputed by the trainer, or the engine's
    log-probs in ``bypass`` mode), pi_ref, the KL reward penalty (its metrics added to ``metrics``), the loss
    mask (minus truncated samples) and the critic's values."""
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
        kl = kl_fn(old, ref).detach()
        token_rewards = kl_reward_penalty(kl, kl_controller.value, batch.response_mask)
        metrics["actor/reward_kl_penalty_coeff"] = kl_controller.value
        # verl's actor/reward_kl_penalty averages empty sequences in as 0; this one leaves them out
        metrics["actor/reward_kl"] = update_kl_controller(kl_controller, kl, batch.response_mask, layout.group)
    loss_mask = batch.response_mask.clone()
    if spec.mask_truncated:
        truncated = torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.bool)
        loss_mask[truncated] = 0.0
    old_values = None if critic is None else score_values(critic, batch, forward, spec.minibatches, layout.group)
    local = RankColumns(
        scores=batch.scores, group_ids=batch.group_ids, response_mask=batch.response_mask,
        token_rewards=token_rewards, old_values=old_values, old_logprobs=old,
        rollout_logprobs=batch.rollout_logprobs, loss_mask=loss_mask, baseline_scores=batch.baseline_scores,
        reward_components=batch.reward_components,
    )  # fmt: skip
    return local, ModelScores(old, recomputed, ref, old_values)


def global_targets(everyone: GatheredColumns, rows: slice, local: RankColumns, scored: ModelScores,
                   spec: TargetsSpec, metrics: dict[str, float]) -> TrainTargets:
    """This rank's ``rows`` of what the whole batch gives: the mismatch corrections, the advantages and
    returns; their metrics (and the mismatch's, when the trainer recomputed pi_old) added to ``metrics``."""
    local_width = local.response_mask.shape[1]

    def mine(x: torch.Tensor) -> torch.Tensor:
        return x[rows, :local_width]

    is_weights = None
    loss_mask = local.loss_mask
    global_mask = everyone.columns.loss_mask
    if spec.corrections:
        weights, global_mask, corr_metrics = compose_corrections(
            spec.corrections, everyone.columns.old_logprobs, everyone.columns.rollout_logprobs, global_mask
        )
        loss_mask = mine(global_mask)
        is_weights = None if weights is None else mine(weights)
        metrics.update(corr_metrics)
    g = everyone.columns
    scores = g.scores
    advantages, returns = compute_advantages(g, spec)
    if scored.recomputed is not None:  # else the report measures it against the first training forward
        metrics.update(mismatch_metrics(g.old_logprobs, g.rollout_logprobs, g.response_mask))
    response_mask = g.response_mask
    metrics["advantage/mean"] = float((advantages * response_mask).sum() / response_mask.sum().clamp(min=1))
    metrics["reward/std"] = scores.std().item() if len(scores) > 1 else 0.0
    metrics["advantage/zero_variance_groups"] = zero_variance_fraction(g.group_ids, scores)
    return TrainTargets(
        advantages=mine(advantages).float(),
        returns=mine(returns).float(),
        loss_mask=loss_mask,
        old_logprobs=scored.old,
        ref_logprobs=scored.ref,
        is_weights=is_weights,
        old_values=scored.old_values,
    )


def compute_advantages(columns: RankColumns, spec: TargetsSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The advantages and returns the estimator (``spec.advantage``) gives the global batch ``columns``."""
    estimator, estimator_cfg = spec.advantage
    return estimator(
        AdvantageInput(
            scores=columns.scores, group_ids=columns.group_ids, response_mask=columns.response_mask,
            token_rewards=columns.token_rewards, values=columns.old_values, baseline_scores=columns.baseline_scores,
            reward_components=columns.reward_components,
            reward_weights=torch.tensor(spec.reward_weights, dtype=torch.float64) if spec.reward_weights else None,
        ),
        estimator_cfg,
    )


def zero_variance_fraction(group_ids: torch.Tensor, scores: torch.Tensor) -> float:
    """The fraction of groups whose rewards are all equal (their GRPO advantages are all zero)."""
    groups: dict[int, list[float]] = {}
    for gid, score in zip(group_ids.tolist(), scores.tolist()):
        groups.setdefault(gid, []).append(score)
    return sum(1 for s in groups.values() if max(s) == min(s)) / max(len(groups), 1)
