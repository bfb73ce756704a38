"""Built-in plugin: train/inference mismatch corrections (``algorithm.corrections``).

Every correction is ``fn(old_logprobs, rollout_logprobs, response_mask, cfg) -> (weights, mask,
metrics)`` with ``d_t = old − roll`` (0 outside the mask) and ``ρ_t = exp(d_t) = π_old/π_roll``;
weights are detached and multiply the per-token policy loss, the mask says which tokens count in the
loss and in its denominators. :func:`rlite.algorithms.mismatch.compose_corrections` chains them in the listed
order. Levels of a log-ratio: ``token`` d_t; ``sequence`` D_i = Σ_t d_t (ratio Π_t ρ_t);
``geometric`` D_i / |o_i| (ratio (Π_t ρ_t)^(1/|o_i|), length invariant). Sequence values are
broadcast over the sequence's tokens.

``tis`` (truncated IS, Yao et al.): w = min(max(exp(level d), lower), upper); mask unchanged.
Defaults: token level, upper 2.0, no lower bound (verl, slime's ``tis_clip=2, tis_clip_low=0``).

``mis`` / ``icepop`` (masked IS): w = exp(level d) if lower ≤ exp(level d) ≤ upper else 0. Outside
the band the token gets weight 0 but stays in the mask (``drop_from_mask=False``, the default: it
still counts in the loss denominators, as verl's IS "l_u" thresholds, slime's icepop and TRL's
``*_mask`` modes do); ``drop_from_mask=True`` also removes it from the mask (verl's RS style, the
denominators shrink). ``mis`` defaults to the sequence level with [0.5, 2.0] (Seq-MIS of Liu, Li et
al.), ``icepop`` to the token level with [0.5, 5.0] (the IcePop blog's α, β).

``rejection`` (rejection sampling; rejected tokens leave the mask, weights None). Per-token
statistic on d: ``k1`` = d = log(π_old/π_roll), ``k2`` = d²/2, ``k3`` = ρ − 1 − d (d clamped to ±20
first); aggregated per ``level``: ``token``, ``seq_sum`` Σ_t, ``seq_mean`` Σ_t/|o_i|, ``seq_max``
max_t (k2/k3 only). k1 keeps a unit when lower ≤ exp(stat) ≤ upper, i.e. the bounds are on the IS
ratio π_old/π_roll, the same direction as every IS weight here; ``lower=None`` means 1/upper.
**verl's k1 is log(π_roll/π_train)**, so a verl k1 threshold "l_u" is rlite's lower=1/u, upper=1/l
(symmetric bounds coincide). k2/k3 keep a unit when stat ≤ upper (no lower bound). ``veto``: any
valid token with ρ < veto rejects its whole sequence (slime's mis.py veto, verl's token veto).
Defaults: k1, seq_mean (geometric RS), upper 1.001, lower 1/1.001, no veto.

``opsm`` (off-policy sequence masking, DeepSeek-V3.2; slime ``compute_opsm_mask``): with
KL_i = Σ_t m (b − lp) / |o_i| where lp are the current log-probs and b the behaviour log-probs
(``behaviour="old"``, π_old as slime; ``"rollout"``, π_roll as TRL and the paper's sampling policy),
a token is dropped when A < 0 and KL_i > delta (A per sequence [B] or per token [B, T], as slime).
It needs ``advantages`` and ``logprobs``, which :func:`~rlite.algorithms.mismatch.compose_corrections` passes
because its signature declares them. Dropped tokens get weight 0 and stay in the mask by default
(slime and TRL keep the denominators); ``drop_from_mask=True`` removes them. Default delta 1e-4.

``batch_norm``: multiplies the weights composed so far by 1/mean so that they average 1 over the
kept tokens (``level="token"``) or over the kept sequences' per-sequence mean weights
(``level="sequence"``), like verl's ``rollout_is_batch_normalize``. The mean is all-reduced over
ranks when torch.distributed is initialised (``all_reduce``). With no incoming weights it is a no-op.

Metric names follow verl where one exists: ``rollout_is_{mean,max,min,std,eff_sample_size}`` over
the applied weights (one value per valid token at the token level, per non-empty sequence at the
sequence levels), ``rollout_is_ratio_fraction_{high,low}`` (raw ratio beyond the bounds),
``masked_fraction`` (valid tokens this correction removed or zero-weighted) and
``seq_masked_fraction`` (non-empty sequences with at least one such token).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from rlite.api import (
    ConfigError,
    CorrectionOutput,
    Register,
    fraction,
    hookimpl,
    log_or_neg_inf,
    masked_log_ratio,
    sequence_mean,
    sequence_sum,
    weight_stats,
)

K3_LOG_RATIO_BOUND = 20.0
"""d is clamped to ±this before exp in the k3 statistic (as verl), so k3 stays finite."""

# --------------------------------------------------------------------------------------------------
# Levels: a per-token quantity aggregated to (per-token broadcast [B, T], per-unit values [U])
# --------------------------------------------------------------------------------------------------

Level = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _token_level(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, x[mask.bool()]


def _per_sequence(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    has_tokens = mask.bool().any(-1)
    return values[:, None].expand(mask.shape), values[has_tokens]


def _sum_level(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_sequence(sequence_sum(x, mask), mask)


def _mean_level(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_sequence(sequence_mean(x, mask), mask)


def _max_level(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lowest = torch.finfo(x.dtype).min
    values = torch.where(mask.bool(), x, torch.full_like(x, lowest)).amax(-1)
    return _per_sequence(values, mask)


IS_LEVELS: dict[str, Level] = {"token": _token_level, "sequence": _sum_level, "geometric": _mean_level}
"""Levels of an importance ratio (tis, mis, icepop)."""

RS_LEVELS: dict[str, Level] = {
    "token": _token_level,
    "seq_sum": _sum_level,
    "seq_mean": _mean_level,
    "seq_max": _max_level,
}
"""Aggregations of a rejection statistic."""


def _k1(d: torch.Tensor) -> torch.Tensor:
    return d


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


def _k3(d: torch.Tensor) -> torch.Tensor:
    d = d.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return torch.expm1(d) - d


RS_STATISTICS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}
"""Per-token rejection statistics of d = log(π_old/π_roll)."""


def _check_name(key: str, value: str, choices: dict) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: invalid value {value!r}. Valid choices: {', '.join(choices)}.")


def _check_band(lower: Optional[float], upper: float) -> None:
    if not upper > 0:
        raise ConfigError(f"upper must be > 0, got {upper}")
    if lower is not None and not 0 <= lower <= upper:
        raise ConfigError(f"lower must be in [0, upper={upper}], got {lower}")


def _masked_metrics(removed: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``masked_fraction`` over valid tokens, ``seq_masked_fraction`` over non-empty sequences."""
    valid = mask.bool()
    removed = removed & valid
    return {
        "masked_fraction": fraction(removed.sum(), valid.sum()),
        "seq_masked_fraction": fraction(removed.any(-1).sum(), valid.any(-1).sum()),
    }


def _weights_like(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask.to(x.dtype)).detach()


# --------------------------------------------------------------------------------------------------
# tis
# --------------------------------------------------------------------------------------------------


@dataclass
class TisConfig:
    """Truncated importance sampling."""

    level: str = "token"
    """token (ρ_t), sequence (Π_t ρ_t) or geometric ((Π_t ρ_t)^(1/|o|))."""
    upper: float = 2.0
    """Cap C: weights above it become C."""
    lower: Optional[float] = None
    """Optional floor: weights below it become it (None: no floor)."""

    def __post_init__(self) -> None:
        _check_name("level", self.level, IS_LEVELS)
        _check_band(self.lower, self.upper)


def truncated_is(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, cfg: TisConfig
) -> CorrectionOutput:
    """w = clamp(exp(level d), lower, upper); the mask is returned unchanged."""
    d = masked_log_ratio(old_logprobs, rollout_logprobs, response_mask)
    level_d, unit_d = IS_LEVELS[cfg.level](d, response_mask)
    weights = torch.exp(level_d).clamp(min=cfg.lower or 0.0, max=cfg.upper)
    unit_w = torch.exp(unit_d).clamp(min=cfg.lower or 0.0, max=cfg.upper)
    metrics = weight_stats(unit_w)
    metrics["rollout_is_ratio_fraction_high"] = fraction((unit_d > math.log(cfg.upper)).sum(), unit_d.numel())
    metrics["rollout_is_ratio_fraction_low"] = fraction(
        (unit_d < log_or_neg_inf(cfg.lower)).sum(), unit_d.numel()
    )
    return _weights_like(weights, response_mask), response_mask, metrics


# --------------------------------------------------------------------------------------------------
# mis / icepop
# --------------------------------------------------------------------------------------------------


@dataclass
class MisConfig:
    """Masked importance sampling (Seq-MIS by default)."""

    level: str = "sequence"
    """token (ρ_t), sequence (Π_t ρ_t) or geometric ((Π_t ρ_t)^(1/|o|))."""
    lower: float = 0.5
    """Ratios below this get weight 0."""
    upper: float = 2.0
    """Ratios above this get weight 0."""
    drop_from_mask: bool = False
    """Also remove out-of-band tokens from the mask (and so from the loss denominators)."""

    def __post_init__(self) -> None:
        _check_name("level", self.level, IS_LEVELS)
        _check_band(self.lower, self.upper)


@dataclass
class IcePopConfig(MisConfig):
    """IcePop: token-level masked importance sampling with the IcePop blog's band."""

    level: str = "token"
    """token (ρ_t), sequence (Π_t ρ_t) or geometric ((Π_t ρ_t)^(1/|o|))."""
    lower: float = 0.5
    """α: ratios below this get weight 0."""
    upper: float = 5.0
    """β: ratios above this get weight 0."""


def masked_is(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, cfg: MisConfig
) -> CorrectionOutput:
    """w = ρ_level inside [lower, upper], 0 outside; optionally drop outside tokens from the mask."""
    d = masked_log_ratio(old_logprobs, rollout_logprobs, response_mask)
    level_d, unit_d = IS_LEVELS[cfg.level](d, response_mask)
    low, high = log_or_neg_inf(cfg.lower), math.log(cfg.upper)
    inside = (level_d >= low) & (level_d <= high)
    weights = torch.where(inside, torch.exp(level_d), torch.zeros_like(level_d))
    unit_inside = (unit_d >= low) & (unit_d <= high)
    unit_w = torch.where(unit_inside, torch.exp(unit_d), torch.zeros_like(unit_d))
    metrics = weight_stats(unit_w)
    metrics["rollout_is_ratio_fraction_high"] = fraction((unit_d > high).sum(), unit_d.numel())
    metrics["rollout_is_ratio_fraction_low"] = fraction((unit_d < low).sum(), unit_d.numel())
    metrics.update(_masked_metrics(~inside, response_mask))
    mask = response_mask
    if cfg.drop_from_mask:
        mask = (response_mask.bool() & inside).to(response_mask.dtype)
    return _weights_like(weights, response_mask), mask, metrics


# --------------------------------------------------------------------------------------------------
# rejection
# --------------------------------------------------------------------------------------------------


@dataclass
class RejectionConfig:
    """Rejection sampling on a k1/k2/k3 statistic of d = log(π_old/π_roll), plus a token veto."""

    statistic: str = "k1"
    """k1 (d), k2 (d²/2) or k3 (ρ − 1 − d)."""
    level: str = "seq_mean"
    """token, seq_sum, seq_mean (geometric for k1) or seq_max (k2/k3 only)."""
    upper: Optional[float] = 1.001
    """k1: largest kept ratio exp(stat) (π_old/π_roll direction); k2/k3: largest kept statistic. None: no test."""
    lower: Optional[float] = None
    """k1 only: smallest kept ratio exp(stat); None means 1/upper."""
    veto: Optional[float] = None
    """Reject a whole sequence if any of its tokens has ρ < veto (None: off)."""

    def __post_init__(self) -> None:
        _check_name("statistic", self.statistic, RS_STATISTICS)
        _check_name("level", self.level, RS_LEVELS)
        if self.statistic == "k1" and self.level == "seq_max":
            raise ConfigError("level seq_max needs a non-negative statistic (k2 or k3), not k1")
        if self.statistic != "k1" and self.lower is not None:
            raise ConfigError(f"lower applies to k1 only; {self.statistic} is non-negative, set upper only")
        if self.upper is not None:
            _check_band(self.lower, self.upper)
        elif self.lower is not None:
            raise ConfigError("lower needs upper (use a large upper for a one-sided k1 test)")
        if self.veto is not None and not self.veto > 0:
            raise ConfigError(f"veto must be > 0, got {self.veto}")

    def keep_band(self) -> tuple[float, float]:
        """Inclusive band on the aggregated statistic that keeps a unit."""
        if self.upper is None:
            return -math.inf, math.inf
        if self.statistic == "k1":
            lower = self.lower if self.lower is not None else 1.0 / self.upper
            return log_or_neg_inf(lower), math.log(self.upper)
        return -math.inf, self.upper


def rejection_sampling(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RejectionConfig,
) -> CorrectionOutput:
    """Drop tokens (token level) or sequences (seq levels, veto) whose statistic leaves the band."""
    valid = response_mask.bool()
    d = masked_log_ratio(old_logprobs, rollout_logprobs, response_mask)
    stat = RS_STATISTICS[cfg.statistic](d)
    level_stat, unit_stat = RS_LEVELS[cfg.level](stat, response_mask)
    low, high = cfg.keep_band()
    rejected = (level_stat < low) | (level_stat > high)
    vetoed_seq = torch.zeros(valid.shape[0], dtype=torch.bool, device=valid.device)
    if cfg.veto is not None:
        vetoed_seq = ((d < math.log(cfg.veto)) & valid).any(-1)
        rejected = rejected | vetoed_seq[:, None]
    rejected = rejected & valid
    metrics = _masked_metrics(rejected, response_mask)
    metrics["veto_fraction"] = fraction(vetoed_seq.sum(), valid.any(-1).sum())
    metrics["statistic_mean"] = unit_stat.double().mean().item() if unit_stat.numel() else 0.0
    metrics["statistic_max"] = unit_stat.double().max().item() if unit_stat.numel() else 0.0
    mask = (valid & ~rejected).to(response_mask.dtype)
    return None, mask, metrics


# --------------------------------------------------------------------------------------------------
# opsm
# --------------------------------------------------------------------------------------------------

OPSM_BEHAVIOURS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "old": lambda old_logprobs, rollout_logprobs: old_logprobs,
    "rollout": lambda old_logprobs, rollout_logprobs: rollout_logprobs,
}
"""Which log-probs stand for the sampling policy in the OPSM divergence."""


@dataclass
class OpsmConfig:
    """Off-policy sequence masking (DeepSeek-V3.2)."""

    delta: float = 1e-4
    """Drop negative-advantage sequences whose mean log-ratio (behaviour − current) exceeds this."""
    behaviour: str = "old"
    """Which log-probs stand for the sampling policy: old (π_old, slime) or rollout (π_roll, TRL)."""
    drop_from_mask: bool = False
    """Also remove dropped tokens from the mask (and so from the loss denominators)."""

    def __post_init__(self) -> None:
        _check_name("behaviour", self.behaviour, OPSM_BEHAVIOURS)


def off_policy_sequence_masking(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: OpsmConfig,
    *,
    advantages: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
) -> CorrectionOutput:
    """Zero tokens of sequences with A < 0 and mean_t(behaviour − lp) > delta."""
    if advantages is None or logprobs is None:
        raise ValueError(
            "opsm needs the advantages and the current log-probs: call compose_corrections(..., "
            "advantages=..., logprobs=...) at loss time"
        )
    valid = response_mask.bool()
    behaviour = OPSM_BEHAVIOURS[cfg.behaviour](old_logprobs, rollout_logprobs)
    seq_kl = sequence_mean(masked_log_ratio(behaviour, logprobs, response_mask), response_mask)
    advantages = advantages.detach()
    negative = (advantages < 0)[:, None] if advantages.dim() == 1 else advantages < 0
    dropped = negative & (seq_kl > cfg.delta)[:, None] & valid
    metrics = _masked_metrics(dropped, response_mask)
    has_tokens = valid.any(-1)
    metrics["seq_kl_mean"] = seq_kl[has_tokens].double().mean().item() if has_tokens.any() else 0.0
    dtype = seq_kl.dtype
    weights = (~dropped).to(dtype)
    mask = response_mask
    if cfg.drop_from_mask:
        mask = (valid & ~dropped).to(response_mask.dtype)
    return _weights_like(weights, response_mask), mask, metrics


# --------------------------------------------------------------------------------------------------
# batch_norm
# --------------------------------------------------------------------------------------------------


def _token_total(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.stack([(w * m).sum(), m.sum()])


def _sequence_total(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    has_tokens = m.bool().any(-1)
    return torch.stack([sequence_mean(w, m)[has_tokens].sum(), has_tokens.sum().to(w.dtype)])


BATCH_NORM_LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token_total,
    "sequence": _sequence_total,
}
"""(sum, count) whose ratio is the mean weight that batch_norm divides by."""


@dataclass
class BatchNormConfig:
    """Normalise the weights composed so far to mean 1."""

    level: str = "token"
    """token: mean over kept tokens; sequence: mean over kept sequences of their mean weight."""
    all_reduce: bool = True
    """All-reduce the sum and count over ranks when torch.distributed is initialised."""

    def __post_init__(self) -> None:
        _check_name("level", self.level, BATCH_NORM_LEVELS)


def batch_normalize(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: BatchNormConfig,
    *,
    weights: torch.Tensor | None = None,
) -> CorrectionOutput:
    """Return the constant factor 1/mean(weights) (composition multiplies it in); None if no weights."""
    if weights is None:
        return None, response_mask, {"rollout_is_batch_norm_factor": 1.0}
    w = weights.detach().to(torch.float64)
    stats = BATCH_NORM_LEVELS[cfg.level](w, response_mask.to(torch.float64))
    if cfg.all_reduce and dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats)
    total, count = stats.tolist()
    mean = total / count if count > 0 else 0.0
    factor = 1.0 / mean if mean > 0 else 1.0
    out = torch.full_like(weights, factor, dtype=weights.dtype)
    return _weights_like(out, response_mask), response_mask, {"rollout_is_batch_norm_factor": mean}


# --------------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------------


@hookimpl
def register_mismatch_corrections(register: Register) -> None:
    register("tis", truncated_is, TisConfig)
    register("mis", masked_is, MisConfig)
    register("icepop", masked_is, IcePopConfig)
    register("rejection", rejection_sampling, RejectionConfig)
    register("opsm", off_policy_sequence_masking, OpsmConfig)
    register("batch_norm", batch_normalize, BatchNormConfig)
