"""Stage 4 of a step: the update of every model the run trains, the policy and PPO's critic, over mini- and
micro-batches of the batch and its targets (stage 3's :class:`~rlite.rollout.TrainTargets`, cut alike,
:mod:`rlite.stages.minibatches`). Each returns its product: :class:`PolicyUpdate`, :class:`CriticUpdate`.

One loop trains both (:func:`train_minibatches`); a model brings only its :data:`Objective` (a micro-batch's
forward and loss: :func:`micro_batch_loss` for the policy, :func:`value_loss` for the critic). Per
mini-batch the loop sums the global counts, runs each micro-batch's objective and backward, then one
optimizer step through the model's ``step`` (:class:`~rlite.training.backend.BackendBase`: clipping, and a
NaN/inf gradient norm skipped); a NaN/inf loss skips the step too, and a skipped step is counted and its
numbers kept out of the averages.

Normalisation is global (``rlite.algorithms.aggregate_loss``): before the first micro-batch of a
mini-batch, the response-token and sequence counts are summed over all data-parallel ranks, so the
gradient equals that of the whole mini-batch whatever the split into ranks and micro-batches.

The critic's value loss is verl's clipped form, aggregated with the run's loss-aggregation mode:

    l_t = 1/2 * max((v_t - G_t)^2, (clip(v_t, v_old - c, v_old + c) - G_t)^2)

(slime omits the 1/2; it only rescales the critic's learning rate). ``critic/vf_clipfrac`` is the
fraction of response tokens where the clipped branch is strictly larger.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from rlite.algorithms import aggregate_loss
from rlite.distributed import all_reduce_max, all_reduce_sum
from rlite.rollout import RolloutBatch, TrainTargets, pad_to_width
from rlite.stages.minibatches import micro_batching, split_minibatches
from rlite.training.backend import CriticModel, ForwardSpec, TrainedModel, TrainingBackend
from rlite.training.device import to_device
from rlite.training.micro_batching import MicroBatching, padding_stats


@dataclass
class LossSpec:
    """The loss of one step: the policy loss plugin plus KL and entropy terms."""

    policy_loss: Callable
    policy_cfg: Any
    agg_mode: str
    horizon: float | None
    kl_fn: Callable | None
    kl_coef: float
    entropy_coef: float
    loss_time_corrections: list = field(default_factory=list)
    """Corrections that need the current log-probs (e.g. OPSM); applied per micro-batch. Tokens they
    reject get weight 0 but stay in the loss denominators (the counts are fixed before the first
    micro-batch)."""


# --------------------------------------------------------------------------------------------------
# one update loop for every trained model
# --------------------------------------------------------------------------------------------------


class StepSums(dict):
    """One optimizer step's metric sums, float64 scalars kept on the device the objective computes on until
    the step ends (reading one would make the host wait for the device). A name starts at 0 when first
    added to; the objective sets ``device`` (where its forward's outputs are) before it adds."""

    device: torch.device | None = None

    def __missing__(self, name: str) -> torch.Tensor:
        value = self[name] = torch.zeros((), dtype=torch.float64, device=self.device)
        return value


@dataclass
class MicroBatch:
    """One micro-batch of an update, as the loop hands it to the model's :data:`Objective`."""

    batch: RolloutBatch
    targets: TrainTargets
    """The targets of its rows (stage 3's)."""
    rows: list[int]
    """Its rows in the whole batch."""
    epoch: int
    counts: dict[str, float]
    """The mini-batch's global counts for :func:`rlite.algorithms.aggregate_loss`: ``global_tokens``,
    ``global_sequences``, ``dp_size``."""


Objective = Callable[[MicroBatch, StepSums], torch.Tensor]
"""A trained model's forward on one micro-batch and that micro-batch's share of the loss (what backward
differentiates); it adds its metrics to the step's sums."""


@dataclass
class UpdatePass:
    """What :func:`train_minibatches` did."""

    metrics: dict[str, float]
    """The objective's metrics, the gradient norm and the learning rate, each averaged over the applied
    updates (none when every update was skipped)."""
    skipped: int
    """Updates skipped for a NaN/inf loss or gradient norm."""
    cuts: list[tuple[RolloutBatch, list[list[int]]]]
    """The first epoch's mini-batches and the rows of their micro-batches."""
    outcomes: list[dict[str, float] | None]
    """One entry per optimizer step, in order: ``None`` for an applied one, the ``loss``, ``grad_norm`` and
    ``lr`` of a skipped one (:class:`rlite.run.faults.NonFiniteGuard` counts them)."""


@dataclass
class StepOutcome:
    """One optimizer step of :func:`train_minibatch`."""

    parts: list[list[int]]
    """The rows of the mini-batch's micro-batches."""
    values: dict[str, float]
    """The objective's metrics, global over ranks."""
    grad_norm: float
    lr: float
    skipped: dict[str, float] | None
    """``None`` for an applied update; the ``loss``, ``grad_norm`` and ``lr`` of a skipped one."""


def train_minibatches(
    model: TrainedModel,
    batch: RolloutBatch,
    targets: TrainTargets,
    objective: Objective,
    cut: MicroBatching,
    *,
    minibatches: int,
    epochs: int,
    dp_size: int,
    dp_group: Any = None,
    norm_metric: str,
    lr_metric: str | None = None,
    before_step: Callable[[], None] | None = None,
    timer=None,
) -> UpdatePass:
    """Train ``model`` on the batch and its ``targets``: ``epochs`` passes over its ``minibatches``
    mini-batches, one optimizer step each (:func:`train_minibatch`), cut into micro-batches by ``cut``.

    An optimizer step whose global loss or global gradient norm is NaN or infinite is skipped: its
    gradients are dropped, optimizer and LR scheduler do not step, its numbers stay out of the averages
    and :attr:`UpdatePass.skipped` counts it (:attr:`UpdatePass.outcomes` says which steps). Both values
    are global, so every rank skips the same steps. The gradient norm is averaged as ``norm_metric``, the
    learning rate as ``lr_metric`` (when given). ``timer`` (a :class:`rlite.metrics.StepTimer`) times the
    parts: ``train/forward`` (forward and loss), ``train/backward``, ``train/optimizer`` (clipping and the
    optimizer step). Counts and metrics are summed over ``dp_group`` (the data-parallel ranks; default all)
    of ``dp_size`` ranks.
    """
    phase = timer.phase if timer is not None else nullcontext
    model.train_mode()
    sums: dict[str, float] = defaultdict(float)
    applied = 0
    cuts: list[tuple[RolloutBatch, list[list[int]]]] = []
    outcomes: list[dict[str, float] | None] = []
    for epoch in range(epochs):
        offset = 0
        for mini, mini_targets in zip(split_minibatches(batch, minibatches), split_minibatches(targets, minibatches)):
            step = train_minibatch(model, mini, mini_targets, offset, epoch, objective, cut, dp_size=dp_size,
                                   dp_group=dp_group, before_step=before_step, phase=phase)
            offset += len(mini)
            if epoch == 0:
                cuts.append((mini, step.parts))
            outcomes.append(step.skipped)
            if step.skipped is not None:
                continue
            applied += 1
            for name, value in step.values.items():
                sums[name] += value
            sums[norm_metric] += step.grad_norm
            if lr_metric is not None:
                sums[lr_metric] += step.lr
    skipped = len(outcomes) - applied
    return UpdatePass({name: value / applied for name, value in sums.items()}, skipped, cuts, outcomes)


def train_minibatch(
    model: TrainedModel, mini: RolloutBatch, targets: TrainTargets, offset: int, epoch: int, objective: Objective,
    cut: MicroBatching, *, dp_size: int, dp_group: Any, before_step: Callable[[], None] | None, phase: Callable,
) -> StepOutcome:
    """One optimizer step on the mini-batch ``mini`` (rows ``offset...`` of the batch) and its ``targets``: the
    objective and backward of each micro-batch, the summed loss checked, then ``model.step``."""
    totals = all_reduce_sum(torch.tensor([targets.loss_mask.sum().item(), float(len(mini))]), dp_group)
    counts = dict(global_tokens=float(totals[0]), global_sequences=float(totals[1]), dp_size=dp_size)
    parts = cut.split(mini)
    # Inside this loop nothing waits for the device: the model reads the micro-batch's host tensors and
    # returns its outputs where it computes, the loss inputs follow them there (asynchronously), and the
    # step's sums stay device tensors until the step ends.
    sums = StepSums()
    for rows in parts:
        micro = MicroBatch(mini.select(rows), targets.select(rows), [offset + r for r in rows], epoch, counts)
        with phase("train/forward"):
            total = objective(micro, sums)
            sums[OBJECTIVE] += total.detach()
        with phase("train/backward"):
            model.backward(total)
    lr = model.current_lr()
    # every summed value is this rank's share x dp_size: average over ranks. Reduced before the optimizer
    # step, so that every rank sees the same global loss and skips alike (one copy to the host).
    sums = sums or {OBJECTIVE: torch.zeros((), dtype=torch.float64)}  # (a rank with no rows)
    local = torch.stack([v.detach().double() for v in sums.values()]).cpu()
    values = dict(zip(sums, (all_reduce_sum(local, dp_group) / dp_size).tolist()))
    loss = values.pop(OBJECTIVE)
    with phase("train/optimizer"):
        if math.isfinite(loss):
            grad_norm = model.step(before_step)
        else:  # backward already left non-finite gradients: drop them, step nothing
            grad_norm = model.step(before_step, skip=True)
    # a non-finite norm: the model skipped the update (the norm is global, so every rank did)
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    skipped = None if finite else dict(loss=loss, grad_norm=grad_norm, lr=lr)
    return StepOutcome(parts, values, grad_norm, lr, skipped)


@dataclass(frozen=True)
class PolicyUpdate:
    """Stage 4's product for the policy (:func:`update_policy`)."""

    metrics: dict[str, float]
    """``actor/*``, ``train/skipped_nonfinite`` and ``batching/*``, averaged over the applied updates."""
    first_pass_logprobs: torch.Tensor
    """``[B, T]`` the log-probs of the first epoch's forwards (the step's report measures the mismatch with them)."""
    outcomes: list[dict[str, float] | None]
    """One entry per optimizer step (:attr:`UpdatePass.outcomes`)."""


@dataclass(frozen=True)
class CriticUpdate:
    """Stage 4's product for PPO's critic (:func:`update_critic`)."""

    metrics: dict[str, float]
    """``critic/*``, averaged over the applied updates."""
    outcomes: list[dict[str, float] | None]
    """One entry per optimizer step (:attr:`UpdatePass.outcomes`)."""


def update_policy(
    backend: TrainingBackend,
    batch: RolloutBatch,
    targets: TrainTargets,
    fwd: ForwardSpec,
    loss: LossSpec,
    *,
    minibatches: int,
    epochs: int,
    dp_size: int,
    before_step: Callable[[], None] | None = None,
    timer=None,
    dp_group: Any = None,
) -> PolicyUpdate:
    """Train the policy on the batch (:func:`train_minibatches` with :func:`micro_batch_loss`): averaged
    metrics, the log-probs seen by the first forward, and each optimizer step's outcome.

    ``targets.old_logprobs`` is optional: when it is absent (one optimizer step per rollout, no corrections)
    the first forward's detached log-probs are pi_old, so the ratio is exactly 1 by construction. Skipped
    updates (NaN/inf loss or gradient norm) are counted in ``train/skipped_nonfinite``; ``before_step``,
    ``timer`` and ``dp_group`` as :func:`train_minibatches` takes them.
    """
    first_pass: list[tuple[list[int], torch.Tensor]] = []  # (rows, log-probs on the model's device)

    def objective(micro: MicroBatch, sums: StepSums) -> torch.Tensor:
        logprobs, entropy = backend.logprobs(micro.batch, fwd, with_entropy=True)
        sums.device = logprobs.device
        if micro.epoch == 0:
            first_pass.append((micro.rows, logprobs.detach()))
        mb, mb_targets = loss_inputs(micro.batch, micro.targets, logprobs.device)
        return micro_batch_loss(mb, mb_targets, logprobs, entropy, loss, micro.counts, sums)

    done = train_minibatches(
        backend, batch, targets, objective, micro_batching(fwd, dp_group), minibatches=minibatches, epochs=epochs,
        dp_size=dp_size, dp_group=dp_group, norm_metric="actor/grad_norm", lr_metric="actor/lr",
        before_step=before_step, timer=timer,
    )
    metrics = done.metrics
    metrics["train/skipped_nonfinite"] = float(done.skipped)
    metrics.update(batching_metrics(batching_shape(done.cuts, fwd), dp_group))
    return PolicyUpdate(metrics, first_pass_logprobs(batch, first_pass), done.outcomes)


def update_critic(
    critic: CriticModel,
    batch: RolloutBatch,
    targets: TrainTargets,
    fwd: ForwardSpec,
    *,
    value_clip: float,
    agg_mode: str,
    horizon: float | None,
    minibatches: int,
    dp_size: int,
    dp_group: Any = None,
) -> CriticUpdate:
    """One pass of the clipped value loss (:func:`value_loss`) over the batch (``targets``: ``old_values``,
    ``returns``, ``loss_mask``), cut as the policy's update cuts it, through the policy's loop
    (:func:`train_minibatches`): ``critic/*`` metrics averaged over the applied updates, skipped updates
    (NaN/inf loss or gradient norm) counted in ``critic/skipped_nonfinite`` and reported in the outcomes."""

    def objective(micro: MicroBatch, sums: StepSums) -> torch.Tensor:
        values = critic.values(micro.batch, fwd)
        sums.device = values.device
        mb_targets = to_device(micro.targets, values.device)
        mask = mb_targets.loss_mask
        per_token, clipped = value_loss(values, mb_targets.old_values, mb_targets.returns, mask, value_clip)
        total = aggregate_loss(per_token, mask, agg_mode, **micro.counts, horizon=horizon)
        share = micro.counts["dp_size"] / max(micro.counts["global_tokens"], 1.0)  # global token means
        sums["critic/vf_loss"] += total.detach().double()
        sums["critic/vf_clipfrac"] += clipped.sum().double() * share
        sums["critic/values_mean"] += (values.detach() * mask).sum().double() * share
        return total

    done = train_minibatches(
        critic, batch, targets, objective, micro_batching(fwd, dp_group), minibatches=minibatches, epochs=1,
        dp_size=dp_size, dp_group=dp_group, norm_metric="critic/grad_norm",
    )
    return CriticUpdate({**done.metrics, "critic/skipped_nonfinite": float(done.skipped)}, done.outcomes)


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss and the clip indicator (see the module docstring)."""
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped) * mask
    return loss, (clipped > unclipped).float() * mask


def loss_inputs(mb: RolloutBatch, targets: TrainTargets, device: torch.device) -> tuple[RolloutBatch, TrainTargets]:
    """What :func:`micro_batch_loss` reads of the micro-batch (its rollout log-probs) and its targets, on
    ``device``, next to the log-probs (moved asynchronously from pinned memory on a GPU; unchanged on the CPU)."""
    if mb.response_mask.device == device:
        return mb, targets
    return dataclasses.replace(mb, rollout_logprobs=to_device(mb.rollout_logprobs, device)), to_device(targets, device)


def first_pass_logprobs(batch: RolloutBatch, first_pass: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    """The first epoch's log-probs of every row, on the batch's device: the micro-batches' results joined
    where they were computed and copied over once."""
    out = torch.zeros_like(batch.response_mask)
    if first_pass:
        rows = [r for part_rows, _ in first_pass for r in part_rows]
        joined = torch.cat([pad_to_width(lp, out.shape[1]) for _, lp in first_pass]).to(out.dtype)
        out[rows] = joined.to(out.device)
    return out


def batching_shape(cuts: list[tuple[RolloutBatch, list[list[int]]]], fwd: ForwardSpec) -> torch.Tensor:
    """Real tokens, computed positions, micro-batches, mini-batches and the positions fixed-size micro-batches
    would compute, summed over the mini-batches of one epoch as ``fwd`` cut them."""
    shape = torch.zeros(5, dtype=torch.float64)
    fixed = MicroBatching(fwd.micro_batch_size)
    for mini, parts in cuts:
        unbudgeted = padding_stats(mini, fixed.split(mini))[1]
        real, computed = padding_stats(mini, parts)
        computed = real if fwd.pack_sequences and not fwd.exact_layout else computed  # packed: no padding
        shape += torch.tensor([real, computed, len(parts), 1, unbudgeted], dtype=torch.float64)
    return shape


def batching_metrics(shape: torch.Tensor, dp_group: Any) -> dict[str, float]:
    """What the micro-batching computed in the step's first epoch, over all ranks: the share of computed
    token positions that were padding (and what fixed-size micro-batches of ``training.micro_batch_size``
    would have padded), positions per micro-batch, micro-batches per mini-batch, and the imbalance
    across ranks (the busiest rank's positions over the mean; 1 is balanced)."""
    real, positions, micro, mini, unbudgeted = shape.tolist()
    busiest = float(all_reduce_max(torch.tensor([int(positions)]), dp_group).item())
    total = all_reduce_sum(torch.tensor([real, positions, micro, unbudgeted, 1.0]), dp_group).tolist()
    real, positions, micro, unbudgeted, ranks = total
    return {
        "batching/padding_fraction": 1.0 - real / max(positions, 1.0),
        "batching/padding_fraction_fixed_size": 1.0 - real / max(unbudgeted, 1.0),
        "batching/tokens_per_micro_batch": positions / max(micro, 1.0),
        "batching/micro_batches": micro / max(ranks * mini, 1.0),
        "batching/rank_imbalance": busiest / max(positions / ranks, 1.0),
    }


OBJECTIVE = "train/objective"
"""The summed loss of a mini-batch (what backward differentiates); checked for NaN/inf before each
optimizer step, not reported."""


def micro_batch_loss(
    mb: RolloutBatch,
    targets: TrainTargets,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    loss: LossSpec,
    counts: dict[str, float],
    step_sums: StepSums,
) -> torch.Tensor:
    """This micro-batch's share of the objective: policy term (times correction weights), KL term,
    entropy bonus, each aggregated with the global counts (``targets``: the micro-batch's). Adds its metrics
    to ``step_sums``."""
    mask = targets.loss_mask
    old = logprobs.detach() if targets.old_logprobs is None else targets.old_logprobs
    advantages = targets.advantages
    per_token, token_metrics = loss.policy_loss(logprobs, old, advantages, mask, loss.policy_cfg)
    if targets.is_weights is not None:
        per_token = per_token * targets.is_weights
    n_tok, n_seq, dp_size = counts["global_tokens"], counts["global_sequences"], counts["dp_size"]
    if loss.loss_time_corrections:
        from rlite.algorithms.mismatch import compose_corrections

        weights, kept, corr_metrics = compose_corrections(
            loss.loss_time_corrections, old, mb.rollout_logprobs, mask, advantages=advantages,
            logprobs=logprobs.detach(),
        )
        per_token = per_token * kept * (1.0 if weights is None else weights)
        for name, value in corr_metrics.items():  # sequence-weighted average over the mini-batch
            step_sums[name] += value * len(mb) / max(n_seq, 1.0) * dp_size
    agg = dict(counts, horizon=loss.horizon)
    pg_loss = aggregate_loss(per_token, mask, loss.agg_mode, **agg)
    total = pg_loss
    if loss.kl_fn is not None and loss.kl_coef != 0.0:
        kl_loss = aggregate_loss(loss.kl_fn(logprobs, targets.ref_logprobs), mask, loss.agg_mode, **agg)
        total = total + loss.kl_coef * kl_loss
        step_sums["actor/kl_loss"] += kl_loss.detach()
    if loss.entropy_coef != 0.0:
        total = total - loss.entropy_coef * aggregate_loss(entropy, mask, loss.agg_mode, **agg)
    step_sums["actor/pg_loss"] += pg_loss.detach()
    token_share = dp_size / max(n_tok, 1.0)  # global token means
    # verl's actor/entropy: the entropy aggregated like the loss (loss_agg_mode)
    step_sums["actor/entropy"] += aggregate_loss(entropy.detach(), mask, loss.agg_mode, **agg)
    for name, values in token_metrics.items():
        step_sums[f"actor/{name}"] += (values.detach().float() * mask).sum() * token_share
    return total
