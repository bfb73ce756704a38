"""How a step's batch is cut into mini- and micro-batches, and the no-grad scoring passes over exactly those
cuts: below the stages that score a batch (:mod:`rlite.stages.targets`: pi_old, pi_ref, the critic's values;
:mod:`rlite.stages.routing`) and the one that trains on it (:mod:`rlite.stages.update`), which cuts it the
same way, so that every row is scored with the shapes it is trained with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from rlite.rollout import RolloutBatch, pad_to_width
from rlite.training.backend import CriticModel, ForwardSpec, ScoringModel
from rlite.training.micro_batching import MicroBatching

Rows = TypeVar("Rows")  # anything cut into rows: a batch, its targets


def micro_batches(batch: RolloutBatch, size: int) -> list[RolloutBatch]:
    return [batch.select(slice(i, i + size)) for i in range(0, len(batch), size)]


def micro_batching(spec: ForwardSpec, group: Any = None) -> MicroBatching:
    """The micro-batching ``spec`` asks for, agreed over the data-parallel ``group``."""
    return MicroBatching(spec.micro_batch_size, spec.max_tokens_per_micro_batch, group,
                         packed=spec.pack_sequences and not spec.exact_layout)


def split_minibatches(batch: Rows, count: int) -> list[Rows]:
    """``count`` equal mini-batches of consecutive rows (of a batch, or of its targets alike)."""
    size = len(batch) // count
    return [batch.select(slice(i * size, (i + 1) * size)) for i in range(count)]


@torch.no_grad()
def score_rows(
    score: Callable[[RolloutBatch], torch.Tensor], batch: RolloutBatch, spec: ForwardSpec, minibatches: int = 1,
    group: Any = None,
) -> torch.Tensor:
    """``[B, T]`` per-token numbers of the batch's responses from ``score`` (a micro-batch's forward, no
    gradient), on the batch's device.

    The batch is cut into exactly the mini- and micro-batches that
    :func:`rlite.stages.update.train_minibatches` uses, so every row is scored with the same shapes (and so
    the same rounding) as in training: pi_old of the first mini-batch equals its first training forward bit
    for bit (ratio exactly 1). ``group``: the data-parallel ranks, which agree on the number of micro-batches
    under a token budget. The micro-batches' results stay where the model computed them until all are done,
    then come to the batch's device in one copy (one wait for a GPU, not one per micro-batch).
    """
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    cut = micro_batching(spec, group)
    rows_done: list[int] = []
    scored: list[torch.Tensor] = []
    offset = 0
    for mini in split_minibatches(batch, minibatches):
        for rows in cut.split(mini):
            scored.append(pad_to_width(score(mini.select(rows)).to(out.dtype), out.shape[1]))
            rows_done.extend(offset + r for r in rows)
        offset += len(mini)
    if scored:
        out[rows_done] = torch.cat(scored).to(out.device)
    return out * batch.response_mask


def score_logprobs(
    model: ScoringModel, batch: RolloutBatch, spec: ForwardSpec, minibatches: int = 1, group: Any = None
) -> torch.Tensor:
    """Log-probs ``[B, T]`` of the batch's responses under ``model`` (pi_old, pi_ref), as :func:`score_rows`."""
    return score_rows(lambda mb: model.logprobs(mb, spec)[0], batch, spec, minibatches, group)


def score_values(
    critic: CriticModel, batch: RolloutBatch, spec: ForwardSpec, minibatches: int = 1, group: Any = None
) -> torch.Tensor:
    """The critic's values ``[B, T]`` of the batch's responses (V_old), as :func:`score_rows`."""
    return score_rows(lambda mb: critic.values(mb, spec), batch, spec, minibatches, group)
