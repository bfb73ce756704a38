"""Built-in advantage estimators: grpo, dr_grpo, rloo, opo, gpg, gdpo, remax, reinforce_pp,
reinforce_pp_baseline, gae.

Every estimator maps an :class:`rlite.algorithms.AdvantageInput` (outcome rewards ``R_i``, group ids,
response mask ``m``, optional per-token rewards and critic values) to ``(advantages, returns)`` of
shape ``[B, T]``, zero where ``m = 0``. All run under ``torch.no_grad``; group statistics are taken in
float64 and cast back to the dtype of the scores (float32 for integer scores).

Group-relative (outcome) estimators, ``g(i)`` the group of response ``i``, ``n_g`` its size,
``mu_g`` its mean reward and ``sigma_g`` its Bessel (n-1) standard deviation::

    grpo      A_i = (R_i - mu_g) / (sigma + eps)      sigma = sigma_g (std_scope="group")
                                                      or the Bessel std of all R (std_scope="batch", TRL)
    dr_grpo   A_i = R_i - mu_g                         (Dr.GRPO: no std division)
    rloo      A_i = R_i - (1/(n_g - 1)) sum_{j in g, j != i} R_j  =  n_g/(n_g - 1) (R_i - mu_g)

    opo       A_i = R_i - b_g,  b_g = sum_{j in g} |o_j| R_j / sum_{j in g} |o_j|   (length-weighted mean)
    gpg       A_i = alpha (R_i - mu_g) / f_norm,  alpha = B / max(#{j : R_j != 0}, 1) over the batch
    gdpo      A = masked_whiten( sum_k w_k (R_ik - mu_gk) / (sigma_gk + eps) )   (reward k of K, weight w_k)

    A_{i,t} = A_i * m_{i,t};  returns = advantages.

``gdpo`` (GDPO, arXiv 2601.05242; verl's ``gdpo``) normalises every reward function's values over
the group separately (a GRPO advantage per function, with grpo's singleton rule), sums them with the
functions' weights, then whitens the sum over all response tokens of the batch (``whiten``). It reads
``AdvantageInput.reward_components``; with a single reward it is GRPO followed by whitening.
``gpg`` (GPG, arXiv 2504.02546) is verl's ``compute_gpg_outcome_advantage``: the group mean without
std division, scaled by the batch size over the number of responses with a non-zero reward.

``remax`` (ReMax, arXiv 2310.10505) uses the reward ``b_i`` of one *greedy* completion of the prompt as
the baseline: ``A_{i,t} = G_{i,t} - b_i m_{i,t}``, ``G`` the undiscounted return-to-go of the
per-token rewards below (with only an outcome reward, ``A_i = R_i - b_i`` on every token); returns
``G``. It registers with ``needs_greedy_baseline=True``, which makes the rollout stage generate and
score one greedy completion per prompt (``AdvantageInput.baseline_scores``).

``eps`` is added *outside* the square root (verl, slime: 1e-6; TRL: 1e-4). A group whose rewards
are all equal gets exactly 0. Singleton groups (``n_g = 1``) have no baseline; ``singleton`` picks
what they get: ``"zero"`` (default; slime, TRL, verl's vectorised RLOO: no comparison, no signal, and
no raw-reward-scaled term mixed into otherwise normalised advantages) or ``"raw"`` (verl's GRPO and
loop RLOO: baseline 0 and, in grpo with group scope, sigma = 1, so ``A = R / (1 + eps)``).

Return-based estimators use per-token rewards ``r_{i,t} = token_rewards_{i,t} * m_{i,t} +
[t = last token with m = 1] * R_i`` (the outcome sits on the last response token, as in verl) and the
scan :func:`discounted_cumsum` ``y_t = x_t + d * y_{t+1}`` run over the *mask = 1 subsequence*:
masked interior tokens (tool / observation spans) are transparent — their reward is dropped, the
running sum passes through unchanged and their output is 0 (verl 0.9.1; verl<=0.8 reset the carry,
slime does not skip them)::

    reinforce_pp           G_{i,t} = sum_{s >= t, m=1} gamma^(#mask-1 tokens in (t, s]) r_{i,s}
                           A = masked_whiten(G) over all mask-1 tokens of the batch; returns = G
    reinforce_pp_baseline  the same with R_i replaced by R_i - b_g, b_g = mu_g (singleton: see above)
    gae                    delta_t = r_t + gamma * V_next(t) - V_t,  A_t = delta_t + gamma*lam*A_next(t)
                           returns = A + V (before whitening), A = masked_whiten(A) if ``whiten``

``V_next(t)`` is the value at the next mask-1 token after ``t`` (0 after the last one: no
bootstrapping of truncated responses, like verl and slime), so a tool span is skipped for the values
too, exactly as verl's loop carries ``nextvalues`` through masked tokens. Whitening is
``(x - mean) / sqrt(var + 1e-8)`` with masked mean and Bessel variance over the batch passed in
(:func:`rlite.algorithms.masked_whiten`).

Departure from verl in ``reinforce_pp_baseline``: verl sums the per-token rewards into the score
*before* the group baseline (a per-sequence constant); here they enter as a return-to-go, so
``reinforce_pp_baseline`` is ``reinforce_pp`` with a group-mean baseline on the outcome. Without
per-token rewards the two agree.

The scan (ALGORITHMS.md §1.6), written directly in backward time: split the row into chunks of
``C`` tokens (``SCAN_CHUNK`` = 32; slime uses 128, but the in-chunk work is O(T C) and 32 measured
fastest on CPU, see benchmarks/RESULTS.md); inside a chunk ``y_local = x_chunk @ M`` with
``M[a, b] = d^(a-b)`` for ``a >= b`` (else 0; d = 0 gives the identity); the chunk starts obey
``y_start[n] = y_local[n, 0] + d^C y_start[n+1]``, the same recurrence with discount ``d^C`` over
``T/C`` values, computed by the same function (recursively, so the sequential depth is
``log_C(T)`` rather than ``T/C``); finally ``y[n, k] = y_local[n, k] + d^(C-k) y_start[n+1]``.
Exact in real arithmetic; in float32 it agrees with the per-token loop to about 1e-6 of the row's
scale. Transparency of masked tokens: each row's mask-1 tokens are packed to the left (a scatter
of the slot index ``cumsum(m) - 1``; skipped when every row is already left-aligned, the usual
right-padded batch), scanned with one constant discount, and gathered back, which is exact and keeps
``M`` shared by all rows. slime's chunked scan has no mask; packing is what carries the next value
across a tool span in GAE as verl's loop does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlite.api import AdvantageInput, ConfigError, Register, hookimpl, masked_whiten

SINGLETON_MODES = ("zero", "raw")
SCAN_CHUNK = 32
"""Default chunk length of the scan: the in-chunk matmul costs O(T * C), the depth is log_C(T)."""
STD_SCOPES = ("group", "batch")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: invalid value {value!r}. Valid choices: {', '.join(choices)}.")


def _check_unit_interval(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{key} must be in [0, 1], got {value}")


# --------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------


@dataclass
class GRPOConfig:
    """Options of ``grpo``."""

    norm_by_std: bool = True
    """Divide by the reward std (False gives Dr.GRPO's mean-only advantage)."""
    std_scope: str = "group"
    """Std of the group (GRPO, verl, slime) or of all rewards in the batch (TRL scale_rewards="batch")."""
    epsilon: float = 1e-6
    """Added to the std outside the square root (verl/slime 1e-6, TRL 1e-4)."""
    singleton: str = "zero"
    """Advantage of a response alone in its group: zero (slime, TRL) or raw = R/(1+eps) (verl)."""

    def __post_init__(self) -> None:
        _check_choice("std_scope", self.std_scope, STD_SCOPES)
        _check_choice("singleton", self.singleton, SINGLETON_MODES)
        if self.epsilon < 0:
            raise ConfigError(f"epsilon must be >= 0, got {self.epsilon}")


@dataclass
class DrGRPOConfig:
    """Options of ``dr_grpo``."""

    singleton: str = "zero"
    """Advantage of a response alone in its group: zero, or raw = R (baseline 0, as verl)."""

    def __post_init__(self) -> None:
        _check_choice("singleton", self.singleton, SINGLETON_MODES)


@dataclass
class RLOOConfig:
    """Options of ``rloo``."""

    singleton: str = "zero"
    """Advantage of a response alone in its group: zero (verl vectorised) or raw = R (verl loop)."""

    def __post_init__(self) -> None:
        _check_choice("singleton", self.singleton, SINGLETON_MODES)


@dataclass
class ReinforcePPConfig:
    """Options of ``reinforce_pp``."""

    gamma: float = 1.0
    """Discount of the return over response tokens."""
    whiten: bool = True
    """Whiten the returns over all response tokens of the batch (the paper's global normalisation)."""

    def __post_init__(self) -> None:
        _check_unit_interval("gamma", self.gamma)


@dataclass
class ReinforcePPBaselineConfig:
    """Options of ``reinforce_pp_baseline``."""

    gamma: float = 1.0
    """Discount of the return over response tokens."""
    whiten: bool = True
    """Whiten over all response tokens of the batch."""
    singleton: str = "zero"
    """Outcome of a response alone in its group: zero, or raw = R (baseline 0, as verl)."""

    def __post_init__(self) -> None:
        _check_unit_interval("gamma", self.gamma)
        _check_choice("singleton", self.singleton, SINGLETON_MODES)


@dataclass
class GAEConfig:
    """Options of ``gae``."""

    gamma: float = 1.0
    """Discount factor (verl default 1.0)."""
    lam: float = 1.0
    """GAE lambda (verl default 1.0; 0.95 is the classic PPO value)."""
    whiten: bool = True
    """Whiten the advantages over the batch (verl always does); returns are taken before whitening."""

    def __post_init__(self) -> None:
        _check_unit_interval("gamma", self.gamma)
        _check_unit_interval("lam", self.lam)


@dataclass
class OPOConfig:
    """Options of ``opo``."""

    singleton: str = "zero"
    """Advantage of a response alone in its group: zero, or raw = R (baseline 0, as verl)."""

    def __post_init__(self) -> None:
        _check_choice("singleton", self.singleton, SINGLETON_MODES)


@dataclass
class GPGConfig:
    """Options of ``gpg``."""

    f_norm: float = 1.0
    """Constant divisor of the advantage (verl: 1.0)."""
    singleton: str = "raw"
    """Advantage of a response alone in its group: raw = alpha R / f_norm (verl: mean 0) or zero."""

    def __post_init__(self) -> None:
        _check_choice("singleton", self.singleton, SINGLETON_MODES)
        if self.f_norm <= 0:
            raise ConfigError(f"f_norm must be > 0, got {self.f_norm}")


@dataclass
class GDPOConfig:
    """Options of ``gdpo``."""

    epsilon: float = 1e-6
    """Added to each reward's group std outside the square root."""
    singleton: str = "zero"
    """Per-reward advantage of a response alone in its group: zero, or raw = R/(1+eps) (verl's GRPO)."""
    whiten: bool = True
    """Whiten the weighted sum over all response tokens of the batch (GDPO, verl)."""

    def __post_init__(self) -> None:
        _check_choice("singleton", self.singleton, SINGLETON_MODES)
        if self.epsilon < 0:
            raise ConfigError(f"epsilon must be >= 0, got {self.epsilon}")


@dataclass
class ReMaxConfig:
    """Options of ``remax`` (none besides the greedy rollout it asks for)."""


# --------------------------------------------------------------------------------------------------
# group statistics
# --------------------------------------------------------------------------------------------------


def group_mean_std(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per response: its group's mean, Bessel std (0 for a singleton) and size, in float64.

    Group ids may be any integers in any order (groups need not be contiguous).
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    x = scores.double()
    n = counts.double()
    # Shift by the group minimum so that a constant group has a mean equal to its reward bit for
    # bit, and its centred rewards (hence its advantages) are exactly 0.
    shift = torch.full_like(n, float("inf")).scatter_reduce(0, inverse, x, reduce="amin")[inverse]
    mean_shifted = torch.zeros_like(n).index_add_(0, inverse, x - shift) / n
    mean = mean_shifted[inverse] + shift
    deviation = x - mean
    sq = torch.zeros_like(n).index_add_(0, inverse, deviation.square())
    std = (sq / (n - 1).clamp(min=1)).sqrt()
    return mean, std[inverse], counts[inverse]


def _batch_std(x: torch.Tensor) -> torch.Tensor:
    """Bessel std of all entries; 0 for fewer than two."""
    if x.numel() < 2:
        return x.new_zeros(())
    return x.std(unbiased=True)


def _out_dtype(scores: torch.Tensor) -> torch.dtype:
    return scores.dtype if scores.is_floating_point() else torch.float32


def _broadcast(per_response: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return per_response.to(dtype)[:, None] * mask.to(dtype)


def _centred(
    scores: torch.Tensor, group_ids: torch.Tensor, singleton: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(R_i - mu_g, sigma_g, is_singleton)`` in float64; a singleton's centred reward is 0 or R."""
    mean, std, count = group_mean_std(scores, group_ids)
    x = scores.double()
    single = count == 1
    centred = torch.where(single, x if singleton == "raw" else torch.zeros_like(x), x - mean)
    return centred, std, single


@torch.no_grad()
def grpo_advantages(batch: AdvantageInput, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage ``(R_i - mu_g) / (sigma + eps)`` broadcast over the response tokens."""
    advantage, std, single = _centred(batch.scores, batch.group_ids, cfg.singleton)
    if cfg.norm_by_std:
        if cfg.std_scope == "group":
            sigma = torch.where(single, torch.ones_like(std), std)  # verl's sigma = 1 for a raw singleton
        else:
            sigma = _batch_std(batch.scores.double()).expand_as(std)
        # advantage == 0 (constant group, zero singleton) stays 0, also with epsilon = 0
        advantage = torch.where(advantage == 0, advantage, advantage / (sigma + cfg.epsilon))
    out = _broadcast(advantage, batch.response_mask, _out_dtype(batch.scores))
    return out, out.clone()


@torch.no_grad()
def dr_grpo_advantages(batch: AdvantageInput, cfg: DrGRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: ``R_i - mu_g`` (no std division) broadcast over the response tokens."""
    advantage, _, _ = _centred(batch.scores, batch.group_ids, cfg.singleton)
    out = _broadcast(advantage, batch.response_mask, _out_dtype(batch.scores))
    return out, out.clone()


@torch.no_grad()
def rloo_advantages(batch: AdvantageInput, cfg: RLOOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``R_i`` minus the mean reward of the *other* responses of its group."""
    x = batch.scores.double()
    mean, _, count = group_mean_std(batch.scores, batch.group_ids)
    n = count.double()
    single = count == 1
    fallback = x if cfg.singleton == "raw" else torch.zeros_like(x)
    # R_i - (n mu - R_i)/(n - 1) rewritten as n/(n - 1) (R_i - mu): exactly 0 on a constant group.
    advantage = torch.where(single, fallback, n / (n - 1).clamp(min=1) * (x - mean))
    out = _broadcast(advantage, batch.response_mask, _out_dtype(batch.scores))
    return out, out.clone()


@torch.no_grad()
def opo_advantages(batch: AdvantageInput, cfg: OPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: ``R_i`` minus the length-weighted mean reward of its group."""
    x = batch.scores.double()
    length = batch.response_mask.double().sum(-1)
    _, inverse, counts = torch.unique(batch.group_ids, return_inverse=True, return_counts=True)
    # shifted by the group minimum, so that a constant group's baseline is its reward bit for bit
    shift = torch.full_like(counts, float("inf"), dtype=torch.float64).scatter_reduce(
        0, inverse, x, reduce="amin")[inverse]
    weighted = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, length * (x - shift))
    total_length = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, length)
    baseline = (weighted / total_length.clamp(min=1))[inverse] + shift  # all-empty group: rows masked anyway
    single = counts[inverse] == 1
    fallback = x if cfg.singleton == "raw" else torch.zeros_like(x)
    advantage = torch.where(single, fallback, x - baseline)
    out = _broadcast(advantage, batch.response_mask, _out_dtype(batch.scores))
    return out, out.clone()


@torch.no_grad()
def gpg_advantages(batch: AdvantageInput, cfg: GPGConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: ``alpha (R_i - mu_g) / f_norm``, ``alpha = B / #nonzero(R)`` over the (global) batch."""
    centred, _, _ = _centred(batch.scores, batch.group_ids, cfg.singleton)
    nonzero = int(torch.count_nonzero(batch.scores))
    alpha = len(batch.scores) / max(nonzero, 1)
    out = _broadcast(centred * alpha / cfg.f_norm, batch.response_mask, _out_dtype(batch.scores))
    return out, out.clone()


@torch.no_grad()
def gdpo_advantages(batch: AdvantageInput, cfg: GDPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: a GRPO advantage per reward function, weighted sum, whitened over the batch."""
    if batch.reward_components is None:
        raise ValueError(
            "algorithm.advantage=gdpo needs each reward function's values (AdvantageInput.reward_components), "
            "but the caller passed none; pass them (the training loop always does) or use grpo"
        )
    components = batch.reward_components.double()
    weights = (
        torch.ones(components.shape[1], dtype=torch.float64)
        if batch.reward_weights is None else batch.reward_weights.double()
    )
    per_reward = GRPOConfig(epsilon=cfg.epsilon, singleton=cfg.singleton)
    total = torch.zeros(len(components), dtype=torch.float64)
    for k in range(components.shape[1]):
        advantage = grpo_advantages(
            AdvantageInput(scores=components[:, k], group_ids=batch.group_ids,
                           response_mask=torch.ones(len(components), 1)), per_reward,
        )[0][:, 0]
        total += weights[k] * advantage
    out = _broadcast(total, batch.response_mask, torch.float64)
    if cfg.whiten:
        out = masked_whiten(out, batch.response_mask.double())
    out = out.to(_out_dtype(batch.scores))
    return out, out.clone()


# --------------------------------------------------------------------------------------------------
# the scan
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _scan_matrices(
    discount: float, width: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``M[a, b] = d^(a-b)`` for ``a >= b`` (else 0) and ``d^(C-k)``, built in float64 (read-only)."""
    k = torch.arange(width, device=device)
    gap = k[:, None] - k[None, :]
    base = torch.tensor(discount, dtype=torch.float64, device=device)
    powers = torch.where(
        gap >= 0, base.pow(gap.clamp(min=0)), torch.zeros((), dtype=torch.float64, device=device)
    )
    return powers.to(dtype), base.pow(width - k).to(dtype)


def _reverse_scan(x: torch.Tensor, discount: float, chunk: int) -> torch.Tensor:
    """``y_t = x_t + discount * y_{t+1}`` along the last dim of ``x`` [B, L], with ``y_L = 0``.

    In-chunk sums are one matmul with ``M[a, b] = d^(a-b)`` for ``a >= b`` (the time-reversed form of
    ALGORITHMS.md §1.6, so no flips); chunk starts obey the same recurrence with discount ``d^C`` and
    are computed recursively; each chunk then adds ``d^(C-k)`` times the next chunk's start.
    """
    batch, length = x.shape
    if length == 0:
        return x.clone()
    width = min(chunk, length)
    n_chunks = -(-length // width)
    pad = n_chunks * width - length
    chunks = (F.pad(x, (0, pad)) if pad else x).reshape(batch, n_chunks, width)
    powers, carry_in = _scan_matrices(discount, width, x.dtype, x.device)
    out = chunks @ powers
    if n_chunks > 1:
        starts = _reverse_scan(out[..., 0], discount**width, chunk)
        next_start = F.pad(starts[:, 1:], (0, 1))
        out.addcmul_(next_start[..., None], carry_in)
    out = out.reshape(batch, n_chunks * width)
    return out[:, :length] if pad else out


def _keep_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(like, dtype=torch.bool) if mask is None else mask.bool()


class _Packing:
    """Moves each row's mask-1 tokens to the left (and back), so that masked tokens are skipped.

    Rows that are already left-aligned (no 0 -> 1 step anywhere, the usual right-padded batch) are
    only truncated; otherwise a token's slot is the number of mask-1 tokens before it.
    """

    def __init__(self, mask: torch.Tensor | None, like: torch.Tensor) -> None:
        self.keep = _keep_mask(mask, like)
        self.weight = self.keep.to(like.dtype)
        self.length = like.shape[1]
        self.width = int(self.weight.sum(-1).max()) if self.keep.numel() else 0
        aligned = self.length < 2 or not bool((self.keep[:, 1:] > self.keep[:, :-1]).any())
        self.slot: torch.Tensor | None = None
        if not aligned:
            count = self.keep.cumsum(-1, dtype=torch.int32)
            self.slot = count.sub_(1).clamp_(min=0).long()  # always < width

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, width]: the mask-1 entries of each row, left-aligned, zero-padded."""
        kept = x * self.weight
        if self.slot is None:
            return kept[:, : self.width]
        # Masked tokens add their 0 to the slot of the previous kept token, which leaves it exact.
        return x.new_zeros(x.shape[0], self.width).scatter_add_(1, self.slot, kept)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[B, width] -> [B, T], zero at masked tokens."""
        if self.slot is None:
            return F.pad(packed, (0, self.length - self.width)) if self.width < self.length else packed
        if self.width == 0:
            return packed.new_zeros(self.keep.shape)
        return packed.gather(1, self.slot).mul_(self.weight)  # slot < width by construction


def discounted_cumsum(
    x: torch.Tensor, mask: torch.Tensor | None = None, discount: float = 1.0, chunk: int = SCAN_CHUNK
) -> torch.Tensor:
    """Chunked scan ``y_t = x_t + discount * y_{t+1}`` over the mask-1 tokens of each row of ``x``.

    Masked tokens are transparent: their ``x`` is ignored, the running sum passes through unchanged
    and their output is 0. Differentiable. Sequential depth ``log_chunk(T)``, ``O(T * chunk)`` work.

    :param x: [B, T] values (rewards, TD errors).
    :param mask: [B, T] 0/1 (or bool); None means all ones.
    :param discount: the factor ``d`` (gamma for returns, gamma * lambda for GAE).
    :param chunk: chunk length ``C`` of the matrix form.
    """
    if chunk < 2:
        raise ValueError(f"chunk must be >= 2, got {chunk}")
    packing = _Packing(mask, x)
    return packing.unpack(_reverse_scan(packing.pack(x), discount, chunk))


def discounted_cumsum_loop(
    x: torch.Tensor, mask: torch.Tensor | None = None, discount: float = 1.0
) -> torch.Tensor:
    """Reference for :func:`discounted_cumsum`: the plain per-token backward loop (verl's RF++ loop)."""
    keep = _keep_mask(mask, x)
    out = torch.zeros_like(x)
    carry = torch.zeros_like(x[:, 0])
    for t in reversed(range(x.shape[1])):
        carry = torch.where(keep[:, t], x[:, t] + discount * carry, carry)
        out[:, t] = torch.where(keep[:, t], carry, torch.zeros_like(carry))
    return out


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    gamma: float,
    lam: float,
    chunk: int = SCAN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation by the chunked scan (no whitening).

    ``delta_t = r_t + gamma V_next(t) - V_t``, ``A_t = delta_t + gamma lam A_next(t)``, where "next" is
    the next mask-1 token (0 after the last). Returns ``(A * m, (A + V) * m)``.
    """
    if chunk < 2:
        raise ValueError(f"chunk must be >= 2, got {chunk}")
    packing = _Packing(mask, values)
    packed_values = packing.pack(values)
    delta = packing.pack(rewards).sub_(packed_values)
    delta[:, :-1].add_(packed_values[:, 1:], alpha=gamma)  # the value after the last token is 0
    advantages = packing.unpack(_reverse_scan(delta, gamma * lam, chunk))
    if packing.slot is None and packing.width == packing.length:
        returns = packed_values.add_(advantages)  # already V * m in place: saves a pass
    else:
        returns = torch.addcmul(advantages, values, packing.weight)
    return advantages, returns


def gae_loop(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`gae`: verl's per-token loop, carrying value and advantage through masked tokens."""
    m = _keep_mask(mask, rewards).to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = candidate * m[:, t] + (1 - m[:, t]) * last
        advantages[:, t] = last
    advantages = advantages * m
    return advantages, (advantages + values) * m


# --------------------------------------------------------------------------------------------------
# return-based estimators
# --------------------------------------------------------------------------------------------------


def per_token_rewards(
    outcome: torch.Tensor, mask: torch.Tensor, token_rewards: torch.Tensor | None = None
) -> torch.Tensor:
    """``token_rewards * m`` plus the outcome ``R_i`` on the last mask-1 token of each row."""
    dtype = token_rewards.dtype if token_rewards is not None else _out_dtype(outcome)
    m = mask.to(dtype)
    rewards = token_rewards * m if token_rewards is not None else torch.zeros_like(m)
    last = m.shape[1] - 1 - m.flip(-1).argmax(-1)
    has_tokens = (m.sum(-1) > 0).to(dtype)
    return rewards.scatter_add(1, last[:, None], (outcome.to(dtype) * has_tokens)[:, None])


def _reinforce_pp(
    batch: AdvantageInput, outcome: torch.Tensor, gamma: float, whiten: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = per_token_rewards(outcome, batch.response_mask, batch.token_rewards)
    returns = discounted_cumsum(rewards, batch.response_mask, gamma)
    advantages = masked_whiten(returns, batch.response_mask) if whiten else returns.clone()
    return advantages, returns


@torch.no_grad()
def reinforce_pp_advantages(
    batch: AdvantageInput, cfg: ReinforcePPConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return of the per-token rewards, whitened over the batch."""
    return _reinforce_pp(batch, batch.scores, cfg.gamma, cfg.whiten)


@torch.no_grad()
def reinforce_pp_baseline_advantages(
    batch: AdvantageInput, cfg: ReinforcePPBaselineConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: REINFORCE++ with the group mean subtracted from the outcome reward."""
    outcome, _, _ = _centred(batch.scores, batch.group_ids, cfg.singleton)
    outcome = outcome.to(_out_dtype(batch.scores))
    return _reinforce_pp(batch, outcome, cfg.gamma, cfg.whiten)


@torch.no_grad()
def remax_advantages(batch: AdvantageInput, cfg: ReMaxConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: the return-to-go minus the greedy completion's reward ``b_i`` on every response token."""
    if batch.baseline_scores is None:
        raise ValueError(
            "algorithm.advantage=remax needs the greedy baseline rewards (AdvantageInput.baseline_scores), "
            "but the caller passed none; the training loop fills them for an estimator registered with "
            "needs_greedy_baseline=True"
        )
    rewards = per_token_rewards(batch.scores, batch.response_mask, batch.token_rewards)
    returns = discounted_cumsum(rewards, batch.response_mask, 1.0)
    advantages = returns - _broadcast(batch.baseline_scores, batch.response_mask, returns.dtype)
    return advantages, returns


@torch.no_grad()
def gae_advantages(batch: AdvantageInput, cfg: GAEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE with a critic; returns before whitening, advantages optionally whitened."""
    if batch.values is None:
        raise ValueError(
            "algorithm.advantage=gae needs critic values, but batch.values is None; "
            "use a critic-free estimator (grpo, rloo, reinforce_pp, ...) or provide values"
        )
    rewards = per_token_rewards(batch.scores, batch.response_mask, batch.token_rewards).to(batch.values.dtype)
    advantages, returns = gae(rewards, batch.values, batch.response_mask, cfg.gamma, cfg.lam)
    if cfg.whiten:
        advantages = masked_whiten(advantages, batch.response_mask)
    return advantages, returns


def needs_group(cfg) -> bool:
    """The group-relative estimators give a sample alone in its group (``rollout.samples_per_prompt=1``)
    advantage 0 with ``singleton: zero``: they need a group to learn anything."""
    return cfg.singleton == "zero"


@hookimpl
def register_advantage_estimators(register: Register) -> None:
    # a lone sample's baseline is itself unless its options say ``singleton: raw`` (baseline 0)
    # each with its float64 reference (end of this module), which rlite audit and rlite.testing.conformance check it against
    register("grpo", grpo_advantages, GRPOConfig, needs_group=needs_group, reference=grpo_reference)
    register("dr_grpo", dr_grpo_advantages, DrGRPOConfig, needs_group=needs_group, reference=dr_grpo_reference)
    register("rloo", rloo_advantages, RLOOConfig, needs_group=needs_group, reference=rloo_reference)
    register("opo", opo_advantages, OPOConfig, needs_group=needs_group, reference=opo_reference)
    register("gpg", gpg_advantages, GPGConfig, needs_group=needs_group, reference=gpg_reference)
    register("gdpo", gdpo_advantages, GDPOConfig, needs_group=needs_group, reference=gdpo_reference)
    register("remax", remax_advantages, ReMaxConfig, needs_greedy_baseline=True, reference=remax_reference)
    register("reinforce_pp", reinforce_pp_advantages, ReinforcePPConfig, reference=reinforce_pp_reference)
    register("reinforce_pp_baseline", reinforce_pp_baseline_advantages, ReinforcePPBaselineConfig,
             needs_group=needs_group, reference=reinforce_pp_baseline_reference)  # fmt: skip
    register("gae", gae_advantages, GAEConfig, needs_critic=True, reference=gae_reference)


# --------------------------------------------------------------------------------------------------
# float64 references: the formulas of the module docstring again, as plain loops over Python floats,
# registered with each estimator (``reference=``) for ``rlite audit`` and ``rlite.testing.conformance``
# --------------------------------------------------------------------------------------------------


def _stats(xs: list[float]) -> tuple[float, float]:
    mu = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mu, sd


def _whiten_rows(rows: list[list[float]], mask: list[list[bool]]) -> list[list[float]]:
    """``(x - mean) / sqrt(var + 1e-8)`` over the mask-1 entries of the batch (Bessel variance; fewer
    than two entries give 0)."""
    kept = [x for row, m in zip(rows, mask) for x, keep in zip(row, m) if keep]
    if len(kept) < 2:
        return [[0.0] * len(row) for row in rows]
    mean = sum(kept) / len(kept)
    scale = math.sqrt(sum((x - mean) ** 2 for x in kept) / (len(kept) - 1) + 1e-8)
    return [[(x - mean) / scale if keep else 0.0 for x, keep in zip(row, m)] for row, m in zip(rows, mask)]


def _outcome_reference(per_response) -> Callable:
    """A reference for an outcome estimator from ``per_response(scores, groups, lengths, cfg, batch) -> [A_i]``:
    ``A_i`` on every response token, returns equal to advantages."""

    def reference(batch: AdvantageInput, cfg) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch.response_mask.double()
        lengths = mask.sum(-1).tolist()
        values = per_response(batch.scores.double().tolist(), batch.group_ids.tolist(), lengths, cfg, batch)
        advantages = torch.tensor(values, dtype=torch.float64)[:, None] * mask
        return advantages, advantages.clone()

    return reference


def _members(groups: list) -> list[list[int]]:
    return [[j for j in range(len(groups)) if groups[j] == groups[i]] for i in range(len(groups))]


def _grpo_one(scores, groups, cfg, norm_by_std: bool, std_scope: str = "group") -> list[float]:
    out = []
    raw = getattr(cfg, "singleton", "zero") == "raw"
    for i, members in enumerate(_members(groups)):
        rs = [scores[j] for j in members]
        mu, sd = _stats(rs)
        if len(rs) == 1 and norm_by_std and raw:  # verl: sigma = 1 (group scope) or the batch std
            sigma = 1.0 if std_scope == "group" else _stats(list(scores))[1]
            a = scores[i] / (sigma + cfg.epsilon)
        elif len(rs) == 1:
            a = scores[i] if raw else 0.0
        else:
            a = scores[i] - mu
            if norm_by_std:
                sigma = sd if std_scope == "group" else _stats(list(scores))[1]
                a = 0.0 if a == 0 else a / (sigma + cfg.epsilon)
        out.append(a)
    return out


def _rloo_one(scores, groups, lengths, cfg, batch) -> list[float]:
    raw = cfg.singleton == "raw"
    out = []
    for i, members in enumerate(_members(groups)):
        rs = [scores[j] for j in members]
        out.append((scores[i] if raw else 0.0) if len(rs) == 1 else scores[i] - (sum(rs) - scores[i]) / (len(rs) - 1))
    return out


def _opo_one(scores, groups, lengths, cfg, batch) -> list[float]:
    raw = cfg.singleton == "raw"
    out = []
    for i, members in enumerate(_members(groups)):
        rs, ls = [scores[j] for j in members], [lengths[j] for j in members]
        baseline = sum(length * r for length, r in zip(ls, rs)) / max(sum(ls), 1)
        out.append((scores[i] if raw else 0.0) if len(rs) == 1 else scores[i] - baseline)
    return out


def _gpg_one(scores, groups, lengths, cfg, batch) -> list[float]:
    raw = cfg.singleton == "raw"
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    out = []
    for i, members in enumerate(_members(groups)):
        rs = [scores[j] for j in members]
        centred = (scores[i] if raw else 0.0) if len(rs) == 1 else scores[i] - _stats(rs)[0]
        out.append(alpha * centred / cfg.f_norm)
    return out


def gdpo_reference(batch: AdvantageInput, cfg: GDPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k w_k (GRPO advantage of reward k, group scope), whitened over the response tokens."""
    components = batch.reward_components.double().tolist()
    weights = [1.0] * len(components[0]) if batch.reward_weights is None else batch.reward_weights.double().tolist()
    groups = batch.group_ids.tolist()
    total = [0.0] * len(components)
    for k, weight in enumerate(weights):
        for i, a in enumerate(_grpo_one([row[k] for row in components], groups, cfg, norm_by_std=True)):
            total[i] += weight * a
    mask = batch.response_mask.bool().tolist()
    rows = [[total[i] if keep else 0.0 for keep in m] for i, m in enumerate(mask)]
    if cfg.whiten:
        rows = _whiten_rows(rows, mask)
    advantages = torch.tensor(rows, dtype=torch.float64)
    return advantages, advantages.clone()


def _return_reference(kind: str) -> Callable:
    """Per-token (advantages, returns) of a return-based estimator (module docstring). Per-token reward:
    ``token_rewards`` on mask-1 tokens plus the outcome on the row's last mask-1 token; masked tokens are
    transparent (the running return and the next value pass through them, output 0); no value after the
    last token. ``reinforce_pp``: G_t = r_t + gamma G_next; ``reinforce_pp_baseline`` the same with the
    outcome R_i - mu_g; ``gae``: delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next,
    returns A + V; ``remax``: G_t - b_i. Whitened over the batch where configured."""

    def reference(batch: AdvantageInput, cfg) -> tuple[torch.Tensor, torch.Tensor]:
        scores, groups = batch.scores.double().tolist(), batch.group_ids.tolist()
        mask = batch.response_mask.bool().tolist()
        width = len(mask[0])
        token_rewards = batch.token_rewards.double().tolist() if batch.token_rewards is not None \
            else [[0.0] * width for _ in scores]
        advantages, returns = [], []
        for i in range(len(scores)):
            outcome = scores[i]
            if kind == "reinforce_pp_baseline":
                rs = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
                outcome = (scores[i] if cfg.singleton == "raw" else 0.0) if len(rs) == 1 else scores[i] - sum(rs) / len(rs)
            tokens = [t for t in range(width) if mask[i][t]]
            reward = {t: token_rewards[i][t] + (outcome if t == tokens[-1] else 0.0) for t in tokens}
            gamma = 1.0 if kind == "remax" else cfg.gamma
            adv, ret = [0.0] * width, [0.0] * width
            later_return = later_value = later_advantage = 0.0
            for t in reversed(tokens):
                if kind == "gae":
                    value = float(batch.values[i, t])
                    delta = reward[t] + gamma * later_value - value
                    later_advantage = delta + gamma * cfg.lam * later_advantage
                    later_value = value
                    adv[t], ret[t] = later_advantage, later_advantage + value
                else:
                    later_return = reward[t] + gamma * later_return
                    ret[t] = later_return
                    adv[t] = later_return - float(batch.baseline_scores[i]) if kind == "remax" else later_return
            advantages.append(adv)
            returns.append(ret)
        if kind != "remax" and cfg.whiten:
            advantages = _whiten_rows(advantages, mask)
        return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)

    return reference


grpo_reference = _outcome_reference(lambda s, g, lengths, cfg, batch: _grpo_one(s, g, cfg, cfg.norm_by_std, cfg.std_scope))
dr_grpo_reference = _outcome_reference(lambda s, g, lengths, cfg, batch: _grpo_one(s, g, cfg, norm_by_std=False))
rloo_reference = _outcome_reference(_rloo_one)
opo_reference = _outcome_reference(_opo_one)
gpg_reference = _outcome_reference(_gpg_one)
remax_reference = _return_reference("remax")
reinforce_pp_reference = _return_reference("reinforce_pp")
reinforce_pp_baseline_reference = _return_reference("reinforce_pp_baseline")
gae_reference = _return_reference("gae")
