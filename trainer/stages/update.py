"""Scoring a batch (old / reference log-probs) and the policy update over mini- and micro-batches.

Normalisation is global (``rlite.algorithms.aggregate_loss``): before the first micro-batch of a
mini-batch, the response-token and sequence counts are summed over all data-parallel ranks, so the
gradient equals that of the whole mini-batch whatever the split into ranks and micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from rlite.algorithms import aggregate_loss
from rlite.distributed import all_reduce_max, all_reduce_sum
from rlite.rollout import RolloutBatch, pad_to_width
from rlite.training.backend import ForwardSpec, ScoringModel, TrainingBackend
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


def micro_batches(batch: RolloutBatch, size: int) -> list[RolloutBatch]:
    return [batch.select(slice(i, i + size)) for i in range(0, len(batch), size)]


def micro_batching(spec: ForwardSpec, group: Any = None) -> MicroBatching:
    """The micro-batching ``spec`` asks for, agreed over the data-parallel ``group``."""
    return MicroBatching(spec.micro_batch_size, spec.max_tokens_per_micro_batch, group,
                         packed=spec.pack_sequences and not spec.exact_layout)


def split_minibatches(batch: RolloutBatch, count: int) -> list[RolloutBatch]:
    size = len(batch) // count
    return [batch.select(slice(i * size, (i + 1) * size)) for i in range(count)]


@torch.no_grad()
def score_logprobs(
    model: ScoringModel, batch: RolloutBatch, spec: ForwardSpec, minibatches: int = 1, group: Any = None
) -> torch.Tensor:
    """Log-probs ``[B, T]`` of the batch's responses under ``model`` (no gradient), on the batch's device.

    The batch is cut into exactly the mini- and micro-batches that :func:`update_policy` uses, so
    every row is scored with the same shapes (and so the same rounding) as in training: pi_old of the
    first mini-batch equals its first training forward bit for bit (ratio exactly 1). ``group``: the
    data-parallel ranks, which agree on the number of micro-batches under a token budget. The
    micro-batches' log-probs stay where the model computed them until all are done, then come to the
    batch's device in one copy (one wait for a GPU, not one per micro-batch).
    """
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    cut = micro_batching(spec, group)
    rows_done: list[int] = []
    scored: list[torch.Tensor] = []
    offset = 0
    for mini in split_minibatches(batch, minibatches):
        for rows in cut.split(mini):
            logprobs = model.logprobs(mini.select(rows), spec)[0]
            scored.append(pad_to_width(logprobs.to(out.dtype), out.shape[1]))
            rows_done.extend(offset + r for r in rows)
        offset += len(mini)
    if scored:
        out[rows_done] = torch.cat(scored).to(out.device)
    return out * batch.response_mask


def update_policy(
    backend: TrainingBackend,
    batch: RolloutBatch,
    fwd: ForwardSpec,
    loss: LossSpec,
    *,
    minibatches: int,
    epochs: int,
    dp_size: int,
    before_step: Callable[[], None] | None = None,
    timer=None,
    dp_group: Any = None,
    outcomes: list[dict[str, float] | None] | None = None,
) -> tuple[dict[str, float], torch.Tensor]:
    """Train on the batch; return averaged metrics and the log-probs seen by the first forward.

    ``batch.targets`` must be filled; its ``old_logprobs`` is optional: when it is absent (one optimizer step per rollout, no corrections) the first forward's detached log-probs
    are pi_old, so the ratio is exactly 1 by construction.
    ``timer`` (a :class:`rlite.metrics.StepTimer`) times the parts: ``train/forward`` (forward and
    loss), ``train/backward``, ``train/optimizer`` (clipping and the optimizer step). Counts and
    metrics are summed over ``dp_group`` (the data-parallel ranks; default all) of ``dp_size`` ranks.

    An optimizer step whose global loss or global gradient norm is NaN or infinite is skipped: its
    gradients are dropped, optimizer and LR scheduler do not step, its numbers stay out of the
    averages and ``train/skipped_nonfinite`` counts it. ``outcomes`` (if given) receives one entry
    per optimizer step in order: ``None`` for an applied one, the loss, norm and learning rate of a
    skipped one. Both values are global, so every rank skips the same steps.
    """
    phase = timer.phase if timer is not None else nullcontext
    backend.train_mode()
    sums: dict[str, float] = defaultdict(float)
    first_pass: list[tuple[list[int], torch.Tensor]] = []  # (rows, log-probs on the model's device)
    optimizer_steps = 0
    skipped: list[dict[str, float]] = []
    cut = micro_batching(fwd, dp_group)
    # real tokens, computed positions, micro-batches, mini-batches, positions of fixed-size micro-batches
    shape = torch.zeros(5, dtype=torch.float64)
    fixed = MicroBatching(fwd.micro_batch_size)
    for epoch in range(epochs):
        offset = 0
        for mini in split_minibatches(batch, minibatches):
            totals = all_reduce_sum(torch.tensor([mini.targets.loss_mask.sum().item(), float(len(mini))]), dp_group)
            counts = dict(global_tokens=float(totals[0]), global_sequences=float(totals[1]), dp_size=dp_size)
            parts = cut.split(mini)
            if epoch == 0:
                unbudgeted = padding_stats(mini, fixed.split(mini))[1]
                real, computed = padding_stats(mini, parts)
                computed = real if fwd.pack_sequences and not fwd.exact_layout else computed  # packed: no padding
                shape += torch.tensor([real, computed, len(parts), 1, unbudgeted], dtype=torch.float64)
            # Inside this loop nothing waits for the device: the backend reads the micro-batch's host tensors
            # and returns log-probs where it computes, the loss inputs follow them there (asynchronously),
            # and the per-step sums stay device tensors until the step ends.
            step_sums: dict[str, torch.Tensor] | None = None
            for rows in parts:
                mb = mini.select(rows)
                with phase("train/forward"):
                    logprobs, entropy = backend.logprobs(mb, fwd, with_entropy=True)
                    if step_sums is None:
                        step_sums = defaultdict(functools.partial(torch.zeros, (), dtype=torch.float64,
                                                                  device=logprobs.device))
                    if epoch == 0:
                        first_pass.append(([offset + r for r in rows], logprobs.detach()))
                    total = micro_batch_loss(loss_inputs(mb, logprobs.device), logprobs, entropy, loss, counts,
                                             step_sums)
                    step_sums[OBJECTIVE] += total.detach()
                with phase("train/backward"):
                    backend.backward(total)
            offset += len(mini)
            lr = backend.current_lr()
            # every summed value is this rank's share x dp_size: average over ranks. Reduced before the
            # optimizer step, so that every rank sees the same global loss and skips alike (one copy to the host).
            step_sums = step_sums or {OBJECTIVE: torch.zeros((), dtype=torch.float64)}  # (a rank with no rows)
            local = torch.stack([v.detach().double() for v in step_sums.values()]).cpu()
            reduced = all_reduce_sum(local, dp_group) / dp_size
            values = dict(zip(step_sums, reduced.tolist()))
            objective = values.pop(OBJECTIVE)
            with phase("train/optimizer"):
                if math.isfinite(objective):
                    grad_norm = backend.step(before_step)
                else:  # backward already left non-finite gradients: drop them, step nothing
                    grad_norm = backend.step(before_step, skip=True)
            if not (math.isfinite(objective) and math.isfinite(grad_norm)):
                # the backend skipped the update (the norm is global, so every rank did)
                skipped.append(dict(loss=objective, grad_norm=grad_norm, lr=lr))
                if outcomes is not None:
                    outcomes.append(skipped[-1])
                continue
            if outcomes is not None:
                outcomes.append(None)
            optimizer_steps += 1
            for name, value in values.items():
                sums[name] += value
            sums["actor/grad_norm"] += grad_norm
            sums["actor/lr"] += lr
    metrics = {name: value / optimizer_steps for name, value in sums.items()}
    metrics["train/skipped_nonfinite"] = float(len(skipped))
    metrics.update(batching_metrics(shape, dp_group))
    return metrics, first_pass_logprobs(batch, first_pass)


def loss_inputs(mb: RolloutBatch, device: torch.device) -> RolloutBatch:
    """The micro-batch with what :func:`micro_batch_loss` reads (its targets and rollout log-probs) on
    ``device``, next to the log-probs (moved asynchronously from pinned memory on a GPU; unchanged on the CPU)."""
    if mb.response_mask.device == device:
        return mb
    return dataclasses.replace(mb, targets=to_device(mb.targets, device),
                               rollout_logprobs=to_device(mb.rollout_logprobs, device))


def first_pass_logprobs(batch: RolloutBatch, first_pass: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    """The first epoch's log-probs of every row, on the batch's device: the micro-batches' results joined
    where they were computed and copied over once."""
    out = torch.zeros_like(batch.response_mask)
    if first_pass:
        rows = [r for part_rows, _ in first_pass for r in part_rows]
        joined = torch.cat([pad_to_width(lp, out.shape[1]) for _, lp in first_pass]).to(out.dtype)
        out[rows] = joined.to(out.device)
    return out


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
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    loss: LossSpec,
    counts: dict[str, float],
    step_sums: dict[str, torch.Tensor],
) -> torch.Tensor:
    """This micro-batch's share of the objective: policy term (times correction weights), KL term,
    entropy bonus, each aggregated with the global counts. Adds its metrics to ``step_sums``."""
    targets = mb.targets
    mask = targets.loss_mask
    old = logprobs.detach() if targets.old_logprobs is None else targets.old_logprobs
    advantages = targets.advantages
    per_token, token_metrics = loss.policy_loss(logprobs, old, advantages, mask, loss.policy_cfg)
    if targets.is_weights is not None:
        per_token = per_token * targets.is_weights
    n_tok, n_seq, dp_size = counts["global_tokens"], counts["global_sequences"], counts["dp_size"]
    if loss.loss_time_corrections:
        from rlite.mismatch import compose_corrections

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
