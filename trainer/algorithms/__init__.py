"""Shared maths primitives of the algorithm plugins: masked statistics and loss aggregation.

Loss aggregation (``../docs/algorithms.md``): one optimizer step consumes a mini-batch of ``N_seq``
sequences and ``N_tok`` response tokens, split over ``D`` data-parallel ranks and ``K``
micro-batches. FSDP averages gradients over ranks and micro-batch gradients add, so every micro-batch
returns its *local numerator* divided by the *global denominator*, times ``D``:

=========================  ===========================================================
mode                       objective over the mini-batch
=========================  ===========================================================
token-mean                 (1/N_tok) sum_i sum_t l_it
seq-mean-token-mean        (1/N_seq) sum_i (1/|o_i|) sum_t l_it
seq-mean-token-sum         (1/N_seq) sum_i sum_t l_it
seq-mean-token-sum-norm    (1/(N_seq H)) sum_i sum_t l_it   (Dr.GRPO, H a constant)
token-sum                  sum_i sum_t l_it                 (verl 0.9.1's token-sum)
=========================  ===========================================================

Fully masked rows count in ``N_seq`` (they contribute zero to the numerator). ``token-sum`` is not
normalised at all: its scale (and the gradient's) grows with the mini-batch's token count N_tok, so it
is N_tok times token-mean, and a learning rate tuned for a mean needs dividing by about N_tok.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AdvantageInput:
    """What an advantage estimator sees. All tensors are on the same device; B responses, width T."""

    scores: torch.Tensor
    """[B] outcome reward of each response."""
    group_ids: torch.Tensor
    """[B] long; responses to the same prompt share an id."""
    response_mask: torch.Tensor
    """[B, T] 1 for response tokens that count (0 for padding and tool/observation tokens)."""
    token_rewards: torch.Tensor | None = None
    """[B, T] per-token rewards added to the outcome (for example -beta * KL), or None."""
    values: torch.Tensor | None = None
    """[B, T] critic values V(s_t), or None for critic-free estimators."""
    baseline_scores: torch.Tensor | None = None
    """[B] reward of the greedy completion of each response's prompt (filled only for an estimator
    registered with ``needs_greedy_baseline=True``, e.g. ReMax), or None."""
    reward_components: torch.Tensor | None = None
    """[B, K] unweighted value of each of the K configured reward functions (``scores`` is their
    weighted sum), or None when the caller has no per-function values."""
    reward_weights: torch.Tensor | None = None
    """[K] weight of each reward function in ``scores = reward_components @ reward_weights``."""


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask); 0 where the mask is empty."""
    total = masked_sum(x, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: float,
    global_sequences: float,
    dp_size: int = 1,
    horizon: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch objective, already scaled for gradient averaging.

    Summing the returned values over micro-batches and *averaging* over ``dp_size`` ranks gives the
    exact objective of the table in the module docstring.

    :param per_token: [b, T] per-token loss of the micro-batch.
    :param mask: [b, T] response mask of the micro-batch.
    :param mode: aggregation mode.
    :param global_tokens: N_tok, response tokens in the whole mini-batch over all ranks.
    :param global_sequences: N_seq, sequences in the whole mini-batch over all ranks.
    :param dp_size: D, number of data-parallel ranks.
    :param horizon: H of ``seq-mean-token-sum-norm``.
    """
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * mask).sum() / max(global_tokens, 1.0) * dp_size
    if mode == "token-sum":
        return (per_token * mask).sum() * dp_size
    per_seq_sum = (per_token * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq_sum / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(global_sequences, 1.0) * dp_size
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / max(global_sequences, 1.0) * dp_size
    if mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon <= 0:
            raise ValueError("seq-mean-token-sum-norm needs a positive horizon H")
        return per_seq_sum.sum() / (max(global_sequences, 1.0) * horizon) * dp_size
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries: ``sum(m (x - mean)^2) / (n - 1)`` (Bessel) or ``/ n``.

    ``n = sum(mask)``. Departs from verl's ``masked_var``, which raises when ``n <= 1``: here the
    variance of fewer than two entries is 0, so whitening such a batch yields zeros instead of
    stopping a run.
    """
    mask = mask.to(x.dtype)
    n = mask.sum()
    centered = (x - masked_mean(x, mask)) * mask
    denom = n - 1 if unbiased else n
    return (centered.square().sum() / denom.clamp(min=1)) * (n > 1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the masked mean and Bessel variance (verl's whitening).

    ``eps`` sits *inside* the square root (as in verl's ``masked_whiten``). The statistics use the
    masked entries only; the result is returned for every position and multiplied by ``mask``, so
    it is 0 where the mask is 0 (verl leaves artefacts there). ``shift_mean=False`` adds the mean
    back, which only rescales.
    """
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask
