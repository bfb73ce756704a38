"""Exact speculative sampling (rlite.engines.speculative): what it emits has exactly the target's
distribution, single tokens and whole sequences, whatever the draft; resampling from p instead of the
residual (a bias seen in the field) fails the same tests. Chi-square goodness of fit, seeded draws."""

from __future__ import annotations

import pytest
import torch

from rlite.engines import speculative
from rlite.engines.speculative import prompt_lookup, verify_proposals
from rlite.testing import chi_square_pvalue

ALPHA = 1e-3
"""A correct sampler must pass every test at this level (the draws are seeded, so it is fixed)."""


def first_token(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int) -> tuple[torch.Tensor, float]:
    """``n`` single-token speculative draws with one proposal from ``q`` (``None``: the deterministic
    proposal ``argmax`` of nothing, token 0); returns the emitted tokens and the acceptance rate."""
    g = torch.manual_seed(seed)
    vocab = p.shape[0]
    if q is None:
        proposals = torch.zeros(n, 1, dtype=torch.long)
        draft = None
    else:
        proposals = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
        draft = q.expand(n, 1, vocab)
    target = p.expand(n, 2, vocab)  # p after the prefix; the bonus position is the same table here
    accepted, nxt = verify_proposals(target, proposals, torch.ones(n, dtype=torch.long), draft)
    emitted = torch.where(accepted == 1, proposals[:, 0], nxt)
    return emitted, float(accepted.double().mean())


def dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


P_RANDOM = dist(0.30, 0.05, 0.20, 0.15, 0.25, 0.05)
Q_RANDOM = dist(0.05, 0.30, 0.10, 0.35, 0.05, 0.15)
CASES = {
    "different": (P_RANDOM, Q_RANDOM),
    "equal": (P_RANDOM, P_RANDOM),
    "disjoint supports": (dist(0.5, 0.5, 0, 0, 0, 0), dist(0, 0, 0.2, 0.3, 0.5, 0)),
    "one-hot q": (P_RANDOM, dist(0, 0, 0, 1, 0, 0)),
    "q zero where p is not": (P_RANDOM, dist(0.5, 0.5, 0, 0, 0, 0)),
    "one-hot p": (dist(0, 1, 0, 0, 0, 0), Q_RANDOM),
}
N = 200_000


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_token_has_the_target_distribution_and_acceptance_sum_min(case):
    p, q = CASES[case]
    emitted, acceptance = first_token(p, q, N, seed=1)
    assert chi_square_pvalue(torch.bincount(emitted, minlength=len(p)), p) > ALPHA
    expected = float(torch.minimum(p, q).sum())  # P(accept) = sum_v min(p, q) = 1 - TV(p, q)
    assert acceptance == pytest.approx(expected, abs=4 * (expected * (1 - expected) / N) ** 0.5 + 1e-12)


def test_a_deterministic_proposal_is_accepted_with_its_target_probability():
    emitted, acceptance = first_token(P_RANDOM, None, N, seed=2)  # always proposes token 0
    assert chi_square_pvalue(torch.bincount(emitted, minlength=6), P_RANDOM) > ALPHA
    assert acceptance == pytest.approx(float(P_RANDOM[0]), abs=0.005)


def test_resampling_from_p_instead_of_the_residual_fails(monkeypatch):
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, x, q, at: p.gather(
        1, at[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1))
    emitted, _ = first_token(P_RANDOM, Q_RANDOM, N, seed=1)
    assert chi_square_pvalue(torch.bincount(emitted, minlength=6), P_RANDOM) < 1e-6


def test_greedy_verification_accepts_exactly_the_argmax_prefix():
    p = torch.tensor([[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1]]] * 3)  # [3, K+1=4, 3]
    proposals = torch.tensor([[1, 0, 1], [1, 0, 2], [2, 0, 2]])
    accepted, nxt = verify_proposals(p, proposals, torch.tensor([3, 3, 3]), greedy=True)
    assert accepted.tolist() == [2, 3, 0]
    assert nxt.tolist() == [2, 0, 1]  # argmax at the first mismatch, or the bonus position
    accepted, nxt = verify_proposals(p, proposals, torch.tensor([1, 0, 3]), greedy=True)
    assert accepted.tolist() == [1, 0, 0] and nxt.tolist() == [0, 1, 1]  # fewer proposals: bonus earlier


# --------------------------------------------------------------------------------------------------
# sequences: a bigram target and a bigram draft, K proposals, rows that accept unevenly
# --------------------------------------------------------------------------------------------------


def bigram(seed: int, vocab: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(vocab, vocab, generator=g, dtype=torch.float64), -1)


def speculative_sequences(target, draft, start: int, length: int, rows: int, k: int, seed: int, deterministic=False):
    """``rows`` sequences of ``length`` tokens after ``start``, decoded speculatively in one batch the
    way the transformers engine does: each row proposes ``min(k, remaining - 1)`` tokens (room for the
    target's own), the draft by sampling its bigram (or, ``deterministic``, its argmax)."""
    torch.manual_seed(seed)
    out = torch.full((rows, length), -1, dtype=torch.long)
    done = torch.zeros(rows, dtype=torch.long)
    last = torch.full((rows,), start, dtype=torch.long)
    while bool((done < length).any()):
        active = (done < length).nonzero().squeeze(1)
        num = (length - done[active] - 1).clamp(max=k)
        prev, proposals, qs = last[active], [], []
        for _ in range(k):
            q = draft[prev]
            x = q.argmax(-1) if deterministic else torch.multinomial(q, 1).squeeze(1)
            proposals.append(x)
            qs.append(q)
            prev = x
        proposals = torch.stack(proposals, 1)
        chain = torch.cat([last[active, None], proposals], 1)  # the prefix's last token, then each proposal
        target_probs = target[chain]  # [R, k + 1, V]
        accepted, nxt = verify_proposals(
            target_probs, proposals, num, None if deterministic else torch.stack(qs, 1)
        )
        emitted = torch.cat([proposals, proposals[:, :1]], 1).scatter(1, accepted[:, None], nxt[:, None])
        count = torch.minimum(accepted + 1, length - done[active])  # x_1..x_n, y; never past the length
        columns = done[active, None] + torch.arange(k + 1)
        keep = torch.arange(k + 1) < count[:, None]
        out[active[:, None].expand_as(columns)[keep], columns[keep]] = emitted[keep]
        done[active] += count
        last[active] = emitted.gather(1, (count - 1)[:, None]).squeeze(1)
    return out


def exact_joint(target, start: int, length: int) -> torch.Tensor:
    """``joint[t1, ..., tL] = P(t1 | start) P(t2 | t1) ... P(tL | tL-1)``."""
    joint = target[start]
    for _ in range(length - 1):  # the last axis (the previous token) meets the bigram's first
        joint = joint[..., None] * target.reshape(*([1] * (joint.dim() - 1)), *target.shape)
    return joint


def sequence_counts(seqs: torch.Tensor, vocab: int) -> torch.Tensor:
    index = torch.zeros(seqs.shape[0], dtype=torch.long)
    for column in range(seqs.shape[1]):
        index = index * vocab + seqs[:, column]
    return torch.bincount(index, minlength=vocab ** seqs.shape[1])


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled draft", "deterministic draft"])
def test_sequences_have_the_target_joint_distribution(deterministic):
    vocab, length = 4, 3
    target, draft = bigram(0, vocab, 1.5), bigram(1, vocab, 1.5)
    seqs = speculative_sequences(target, draft, start=0, length=length, rows=60_000, k=3, seed=3,
                                 deterministic=deterministic)
    joint = exact_joint(target, 0, length)
    assert torch.allclose(joint.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert chi_square_pvalue(sequence_counts(seqs, vocab), joint) > ALPHA


def test_sequences_with_resampling_from_p_fail(monkeypatch):
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, x, q, at: p.gather(
        1, at[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1))
    vocab, length = 4, 3
    target, draft = bigram(0, vocab, 1.5), bigram(1, vocab, 1.5)
    seqs = speculative_sequences(target, draft, start=0, length=length, rows=60_000, k=3, seed=3)
    assert chi_square_pvalue(sequence_counts(seqs, vocab), exact_joint(target, 0, length)) < 1e-6


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    context = [5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6]
    assert prompt_lookup(context, k=3, min_match=1, max_match=3) == [1, 2, 5]  # "5 6" last seen before "1 2"
    assert prompt_lookup(context, k=2, min_match=3, max_match=3) == []  # "2 5 6" never recurs... once: no
    assert prompt_lookup([1, 2, 3, 4], k=4, min_match=1, max_match=2) == []
    assert prompt_lookup([3, 1, 3], k=4, min_match=1, max_match=2) == [1, 3]
