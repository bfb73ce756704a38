"""aggregate_loss: every mode against its objective written as loops, and sharding invariance.

The invariance test simulates D = 2 data-parallel ranks x K = 2 micro-batches: each micro-batch
calls ``aggregate_loss`` with the global counts, a rank sums its micro-batches (gradient
accumulation), and the ranks are averaged (what FSDP/DDP do to gradients). Loss and gradient with
respect to the log-probs must equal the single-process, single-micro-batch ones.
"""

from __future__ import annotations

import pytest
import torch

from rlite.algorithms import aggregate_loss
from rlite.plugins.policy_losses import PPOClipConfig, ppo_clip_loss

torch.set_num_threads(1)

MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
HORIZON = 16.0
# Uneven lengths, a fully masked row and an interior masked token, so that the per-micro-batch mean
# of means (verl<=0.8, TRL "bnpo") would differ from the global objective.
LENGTHS = [6, 1, 3, 0, 5, 2, 6, 4]
B, T = len(LENGTHS), 6


def make_case():
    generator = torch.Generator().manual_seed(0)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    mask[0, 2] = 0  # a tool token inside a response
    old = -torch.rand(B, T, generator=generator, dtype=torch.float64) * 3
    logprobs = (old + 0.3 * torch.randn(B, T, generator=generator, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.randn(B, T, generator=generator, dtype=torch.float64)
    return logprobs, old, advantages, mask


def hand_objective(per_token: list[list[float]], mask: list[list[int]], mode: str) -> float:
    n_tok = sum(sum(row) for row in mask)
    total = 0.0
    for i in range(len(mask)):
        row_sum = sum(per_token[i][t] for t in range(T) if mask[i][t])
        row_len = sum(mask[i])
        if mode == "token-mean":
            total += row_sum / n_tok
        elif mode == "token-sum":
            total += row_sum
        elif mode == "seq-mean-token-mean":
            total += (row_sum / row_len if row_len else 0.0) / len(mask)
        elif mode == "seq-mean-token-sum":
            total += row_sum / len(mask)
        else:
            total += row_sum / (len(mask) * HORIZON)
    return total


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_matches_its_objective(mode: str) -> None:
    generator = torch.Generator().manual_seed(1)
    per_token = torch.randn(B, T, generator=generator, dtype=torch.float64)
    per_token[3] = 1e6  # a fully masked row contributes nothing
    _, _, _, mask = make_case()
    got = aggregate_loss(
        per_token, mask, mode, global_tokens=float(mask.sum()), global_sequences=float(B), horizon=HORIZON
    )
    assert got.item() == pytest.approx(hand_objective(per_token.tolist(), mask.tolist(), mode), rel=1e-13)


def sharded_loss(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, ranks: int, micro: int
) -> torch.Tensor:
    n_tok, n_seq = float(mask.sum()), float(mask.shape[0])
    pieces = torch.arange(mask.shape[0]).chunk(ranks * micro)
    rank_losses = []
    for rank in range(ranks):
        rank_loss = 0.0
        for k in range(micro):
            rows = pieces[rank * micro + k]
            rank_loss = rank_loss + aggregate_loss(
                per_token[rows],
                mask[rows],
                mode,
                global_tokens=n_tok,
                global_sequences=n_seq,
                dp_size=ranks,
                horizon=HORIZON,
            )
        rank_losses.append(rank_loss)
    return torch.stack(rank_losses).mean()


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_times_two_micro_batches_equal_one_by_one(mode: str) -> None:
    logprobs, old, advantages, mask = make_case()
    per_token, _ = ppo_clip_loss(logprobs, old, advantages, mask, PPOClipConfig())
    single = sharded_loss(per_token, mask, mode, ranks=1, micro=1)
    (grad_single,) = torch.autograd.grad(single, logprobs, retain_graph=True)
    sharded = sharded_loss(per_token, mask, mode, ranks=2, micro=2)
    (grad_sharded,) = torch.autograd.grad(sharded, logprobs)
    assert sharded.item() == pytest.approx(single.item(), rel=1e-13)
    torch.testing.assert_close(grad_sharded, grad_single, rtol=1e-13, atol=1e-16)
    assert single.item() == pytest.approx(hand_objective(per_token.tolist(), mask.tolist(), mode), rel=1e-13)


def test_local_means_would_not_be_invariant() -> None:
    """Sanity check that the invariance test can fail: a mean of per-micro-batch token means differs."""
    logprobs, old, advantages, mask = make_case()
    per_token, _ = ppo_clip_loss(logprobs, old, advantages, mask, PPOClipConfig())
    pieces = torch.arange(B).chunk(4)
    local = torch.stack([(per_token[r] * mask[r]).sum() / mask[r].sum() for r in pieces]).mean()
    exact = aggregate_loss(per_token, mask, "token-mean", global_tokens=float(mask.sum()), global_sequences=B)
    assert abs(local.item() - exact.item()) > 1e-3


def test_errors() -> None:
    x, m = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="horizon"):
        aggregate_loss(x, m, "seq-mean-token-sum-norm", global_tokens=6, global_sequences=2)
    with pytest.raises(ValueError, match="unknown"):
        aggregate_loss(x, m, "token-sum-mean", global_tokens=6, global_sequences=2)
