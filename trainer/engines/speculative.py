"""Exact speculative sampling and prompt-lookup proposals: the engine-side maths of speculative decoding,
in plain torch, for any engine that verifies drafts itself (the transformers engine does).

One verification of row ``b`` (Leviathan et al. 2023, Alg. 1; Chen et al. 2023). A draft proposed
``x_1..x_k`` (``k = k_b``), each ``x_i`` drawn from the draft's distribution ``q_i`` (a one-hot ``q_i``
for deterministic proposers such as prompt lookup); one forward of the target over the prefix and
the proposals gives its sampling distributions ``p_1..p_{k+1}`` (temperature, top-k and top-p
applied, as in plain sampling). Then:

1. ``x_i`` is accepted when ``u_i < p_i(x_i) / q_i(x_i)``, ``u_i ~ U[0, 1)``; ``n`` = the number of
   leading accepts.
2. If ``n < k``: one token ``y ~ norm(max(0, p_{n+1} - q_{n+1}))`` (the residual; ``p_{n+1}`` itself
   in the measure-zero case where the residual has no mass, i.e. ``p = q``). Else the bonus token
   ``y ~ p_{k+1}``.
3. The row emits ``x_1..x_n, y``.

Every emitted token then has exactly the target's distribution given its prefix, whatever the draft
(``tests/unit/test_speculative_sampling.py`` checks it with chi-square tests, and that resampling from
``p`` instead of the residual fails them). Greedy verification accepts while ``x_i = argmax p_i`` and
emits ``argmax p_{n+1}``: exactly greedy decoding. Per row, the expected tokens per verification are
``(1 - a^(k+1)) / (1 - a)`` with ``a = sum_v min(p, q)`` when every position has acceptance ``a``.
"""

from __future__ import annotations

import torch

from rlite.engines.sampling import sample_categorical


def verify_proposals(
    target_probs: torch.Tensor,
    proposals: torch.Tensor,
    num_proposals: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batched verification; returns ``(accepted [R], next_token [R])``.

    :param target_probs: ``[R, K + 1, V]`` the target's sampling distribution after the prefix and
        after each proposal (rows need not be normalised; zero where top-k/top-p filtered).
    :param proposals: ``[R, K]`` proposed tokens; a row uses its first ``num_proposals[r]``.
    :param num_proposals: ``[R]`` proposals per row (0 to K): a row with 0 is a plain sampling step.
    :param draft_probs: ``[R, K, V]`` the distributions the proposals were drawn from, or ``None`` for
        deterministic proposals (``q_i`` one-hot at ``x_i``).
    :param greedy: argmax verification (temperature 0).

    ``accepted[r]`` is the number of leading proposals accepted; the row emits them, then
    ``next_token[r]``. Random numbers come from torch's global generator (``K`` uniforms and one
    categorical draw per row).
    """
    rows, k = proposals.shape
    device = proposals.device
    positions = torch.arange(k, device=device)
    valid = positions[None, :] < num_proposals[:, None]
    if k == 0:
        ok = torch.zeros(rows, 0, dtype=torch.bool, device=device)
    elif greedy:
        ok = proposals == target_probs[:, :k].argmax(-1)
    else:
        p_at_x = target_probs[:, :k].gather(-1, proposals[..., None]).squeeze(-1).double()
        if draft_probs is None:
            q_at_x = torch.ones_like(p_at_x)
        else:
            q_at_x = draft_probs.gather(-1, proposals[..., None]).squeeze(-1).double()
        u = torch.rand(rows, k, dtype=torch.float64, device=device)
        ok = u * q_at_x < p_at_x  # u < p / q, without dividing by a q of 0
    accepted = (ok & valid).long().cumprod(-1).sum(-1)
    index = accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])
    p_next = target_probs.gather(1, index).squeeze(1)
    if greedy:
        return accepted, p_next.argmax(-1)
    rejected = accepted < num_proposals
    if bool(rejected.any()):
        residual = residual_distribution(target_probs, proposals, draft_probs, accepted)
        p_next = torch.where(rejected[:, None], residual, p_next)
    return accepted, sample_categorical(p_next)


def residual_distribution(
    target_probs: torch.Tensor, proposals: torch.Tensor, draft_probs: torch.Tensor | None, position: torch.Tensor
) -> torch.Tensor:
    """``max(0, p - q)`` at each row's ``position`` (unnormalised, ``[R, V]``); ``p`` where it has no mass.

    For a deterministic proposal ``q`` is one-hot at the proposed token, so the residual is ``p`` with
    that token removed.
    """
    vocab = target_probs.shape[-1]
    at = position.clamp(max=proposals.shape[1] - 1)
    p = target_probs.gather(1, at[:, None, None].expand(-1, 1, vocab)).squeeze(1).double()
    if draft_probs is None:
        residual = p.scatter(-1, proposals.gather(1, at[:, None]), 0.0)
    else:
        q = draft_probs.gather(1, at[:, None, None].expand(-1, 1, vocab)).squeeze(1).double()
        residual = (p - q).clamp(min=0.0)
    empty = residual.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)


def prompt_lookup(context: list[int], k: int, min_match: int, max_match: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the context's last
    ``n`` tokens, trying ``n = max_match`` down to ``min_match``; ``[]`` when no suffix recurs.

    The proposals of an n-gram draft (prompt lookup decoding, Saxena 2023): free to compute, and
    good wherever a completion copies from its prompt or repeats itself.
    """
    length = len(context)
    if k <= 0:
        return []
    for n in range(min(max_match, length - 1), min_match - 1, -1):
        suffix = context[length - n :]
        for start in range(length - n - 1, -1, -1):  # most recent occurrence first, not the suffix itself
            if context[start : start + n] == suffix:
                follow = context[start + n : start + n + k]
                if follow:
                    return follow
    return []
