"""Built-in policy losses: ppo_clip, gspo, cispo, sapo, gmpo, gpg, reinforce_tis, vespo.

Each loss maps ``(logprobs, old_logprobs, advantages, response_mask, cfg)`` ([B, T]; only ``logprobs``
carries a gradient, the others are detached here) to ``(per_token_loss, token_metrics)``. The
per-token loss is to be *minimised*, is 0 where the mask is 0, and is aggregated by the trainer with
:func:`rlite.algorithms.aggregate_loss` after multiplying by any mismatch-correction weights. Metrics
are per-token [B, T] values (0 at masked tokens) that the trainer averages over response tokens,
named as verl logs them: ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``.

Notation: ``lp`` current log-prob, ``old`` pi_old's, ``A`` advantage, ``sg`` stop-gradient.

ppo_clip (PPO, DAPO clip-higher, dual-clip PPO)::

    log r = clamp(lp - old, -c_log, c_log)        (c_log = log_ratio_clamp, 20 like verl; None = off)
    l1 = -A r,  l2 = -A clip(r, 1 - clip_low, 1 + clip_high),  l = max(l1, l2)
    dual clip (dual_clip_c = c, off by default):  l = min(l, -c A) where A < 0
    pg_clipfrac = [l2 > l1],  pg_clipfrac_lower = [A < 0 and max(l1, l2) > -c A],  ppo_kl = old - lp

    Defaults depart from verl: dual clip is *off* (slime and TRL default; verl always applies c = 3),
    so ``dual_clip_c: 3.0`` reproduces verl; ``log_ratio_clamp: null`` reproduces slime and TRL. With
    the clamp the gradient is 0 once |lp - old| > 20 (the token is far outside any clip range, so
    this only removes a huge, meaningless gradient). ``ppo_kl`` is the unclamped k1 of KL(pi_old||pi).

gspo (GSPO, in verl's GSPO-token form)::

    log s_{i,t} = lp_t - sg(lp_t) + sg( (1/|o_i|) sum_t m (lp - old) ),  clamped above at 10 (verl)
    l = max(-A s, -A clip(s, 1 - 3e-4, 1 + 4e-4))          (no dual clip)

    The value of s_{i,t} is the sequence ratio s_i for every token and d s_{i,t} / d lp_t = s_i, so
    with ``seq-mean-token-mean`` aggregation and a per-sequence advantage the gradient is exactly the
    paper's sequence-level one, d s_i / d lp_t = s_i / |o_i|. With the default token-mean
    aggregation each sequence is weighted by its length instead (verl 0.9.1 behaviour; verl<=0.8 and
    the paper use seq-mean-token-mean).

cispo (MiniMax-M1)::

    w = clip(r, 1 - eps_low, 1 + eps_high)   (mode "bounded": verl, slime)
    w = min(r, eps_high)                     (mode "absolute": TRL's loss_type="cispo", eps_high a cap)
    l = -sg(w) A lp,   pg_clipfrac = [w != r],   log r clamped to +-20 like verl

    Every token keeps the gradient -w A grad(lp); the loss *value* contains lp and is not comparable
    with PPO loss values. Defaults eps_low = 1.0 (no lower bound, as the paper does) and eps_high = 4.0
    (cap 5, TRL's recommended absolute cap); verl and slime default to their PPO ranges (0.2, 0.2 / 0.28).

sapo (Soft Adaptive Policy Optimization, arXiv 2511.20347; verl's ``sapo``)::

    log r = clamp(lp - old, -c_log, c_log),   tau = tau_pos where A > 0 else tau_neg
    l = -A (4 / tau) sigmoid(tau (r - 1))

    A smooth gate instead of a hard clip: its gradient -A 4 sigma(1 - sigma) r grad(lp) equals PPO's
    -A r grad(lp) at r = 1 and decays smoothly away from it. verl 0.9.1 always aggregates SAPO as
    seq-mean-token-mean (the paper's 1/G sum_i 1/|o_i|); here ``loss_agg_mode`` decides (set
    ``seq-mean-token-mean`` to reproduce the paper). Metric: ``ppo_kl``.

gmpo (Geometric-Mean Policy Optimization, arXiv 2507.20673; verl's ``geo_mean``)::

    x = lp - old;   x~ = sgn(A) min(sgn(A) x, sgn(A) clamp(x, -clip_low, clip_high))   (token level)
    s_i = exp( sum_t m x~ / |o_i| ),   A_i = sum_t m A / |o_i|,   l_i = -A_i s_i

    The clip acts in log space and only on the side that matters for the sign of A (above for A > 0,
    below for A < 0). ``l_i`` is written on every response token of sequence i, so
    ``seq-mean-token-mean`` gives verl's plain mean over sequences (the paper); token-mean weights
    sequences by length. Metrics as verl defines them: ``pg_clipfrac = [x != clamp(x)] and A > 0``,
    ``pg_clipfrac_lower = [x != clamp(x)] and A < 0`` (out of range, whether or not the sign-aware
    min picked the clamp), ``ppo_kl``.

gpg (Group Policy Gradient, arXiv 2504.02546; verl's ``gpg``)::

    l = -A lp        (no ratio, no clip: plain REINFORCE on the advantages)

reinforce_tis (REINFORCE with truncated importance weights; verl's bypass-mode ``reinforce``)::

    log w = clamp(sg(lp) - old, -20, 20)          (level "token"; "sequence": sum_t m (sg(lp) - old))
    w = min(exp(log w), is_threshold)             (is_threshold null: no truncation)
    l = -sg(w) A lp

    With ``algorithm.old_logprob_mode: bypass`` the old log-probs are the engine's, so w is
    pi_theta / pi_rollout computed at loss time, as verl's bypass mode with loss_type "reinforce" does
    (verl defaults to seq-mean-token-sum aggregation there). Metrics: ``ppo_kl`` (= old - lp, verl's
    KL(pi_old || pi_theta) k1), ``is_weight_mean`` (mean applied weight), ``is_truncated_frac``
    (fraction of tokens whose weight was truncated).

vespo (Variational sEquence-level Soft Policy Optimization, arXiv 2602.10693; TRL's loss_type "vespo")::

    log w_i = clamp( sum_t m clamp(sg(lp) - old, -20, 20),  log 1e-8, 20 )      (sequence IS weight, a sum)
    (k, lam) = (k_pos, lambda_pos) where A >= 0, else (k_neg, lambda_neg)
    phi = exp(lam + k log w_i - lam w_i) = w_i^k e^{lam (1 - w_i)}          (phi(1) = 1; non-finite -> 0)
    l = -sg(phi) A lp

    A smooth, asymmetric Gamma-shaped weight on the *whole sequence's* ratio (no 1/|o_i|, no clip): it
    peaks at w = k / lam and vanishes as w -> 0 and w -> infinity. Exactly TRL's ``get_gamma_weights``
    (same clamps, defaults 2, 3, 3, 2); TRL aggregates it as "dapo" (token-mean, the recipe's choice).
    TRL folds its vLLM token IS ratio pi_old/pi_sampler into log w; here the same w = pi_theta/pi_rollout
    comes from ``algorithm.old_logprob_mode: bypass`` (configs/vespo.yaml). Metrics: ``ppo_kl``,
    ``vespo_phi_mean`` (mean applied weight; TRL's ``vespo/phi_seq_mean`` averages over sequences).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from rlite.api import ConfigError, Register, hookimpl, masked_mean

CISPO_MODES = ("bounded", "absolute")
IS_LEVELS = ("token", "sequence")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass
class PPOClipConfig:
    """Options of ``ppo_clip``."""

    clip_low: float = 0.2
    """Lower clip range: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """Upper clip range: the ratio is clipped above at 1 + clip_high (DAPO clip-higher uses 0.28)."""
    dual_clip_c: Optional[float] = None
    """Dual-clip constant c > 1 capping the loss of negative-advantage tokens at -c*A (verl: 3.0); None = off."""
    log_ratio_clamp: Optional[float] = 20.0
    """Clamp lp - old to +-this before exp (verl: 20); None = no clamp (slime, TRL)."""

    def __post_init__(self) -> None:
        _check(0 <= self.clip_low < 1, f"clip_low must be in [0, 1), got {self.clip_low}")
        _check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        _check(
            self.dual_clip_c is None or self.dual_clip_c > 1,
            f"dual_clip_c must be > 1, got {self.dual_clip_c}",
        )
        _check(
            self.log_ratio_clamp is None or self.log_ratio_clamp > 0,
            f"log_ratio_clamp must be positive or null, got {self.log_ratio_clamp}",
        )


@dataclass
class GSPOConfig:
    """Options of ``gspo``."""

    clip_low: float = 3e-4
    """Lower clip range of the sequence ratio (paper: 3e-4)."""
    clip_high: float = 4e-4
    """Upper clip range of the sequence ratio (paper: 4e-4)."""
    log_ratio_max: Optional[float] = 10.0
    """Upper clamp of log s before exp (verl: 10); None = off."""

    def __post_init__(self) -> None:
        _check(0 <= self.clip_low < 1, f"clip_low must be in [0, 1), got {self.clip_low}")
        _check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")


@dataclass
class CISPOConfig:
    """Options of ``cispo``."""

    eps_low: float = 1.0
    """Bounded mode: the IS weight is clipped below at 1 - eps_low (>= 1 means no lower bound, as the paper)."""
    eps_high: float = 4.0
    """Bounded mode: clipped above at 1 + eps_high. Absolute mode: clipped above at eps_high itself (TRL)."""
    mode: str = "bounded"
    """bounded: clip(r, 1-eps_low, 1+eps_high) (verl, slime); absolute: min(r, eps_high) (TRL)."""
    log_ratio_clamp: Optional[float] = 20.0
    """Clamp lp - old to +-this before exp (verl: 20); None = no clamp."""

    def __post_init__(self) -> None:
        if self.mode not in CISPO_MODES:
            raise ConfigError(f"mode: invalid value {self.mode!r}. Valid choices: {', '.join(CISPO_MODES)}.")
        _check(self.eps_low >= 0, f"eps_low must be >= 0, got {self.eps_low}")
        _check(self.eps_high > 0, f"eps_high must be > 0, got {self.eps_high}")


@dataclass
class SAPOConfig:
    """Options of ``sapo``."""

    tau_pos: float = 1.0
    """Gate temperature of tokens with A > 0 (verl, paper: 1.0)."""
    tau_neg: float = 1.05
    """Gate temperature of tokens with A <= 0 (verl, paper: 1.05)."""
    log_ratio_clamp: Optional[float] = 20.0
    """Clamp lp - old to +-this before exp (verl: 20); None = no clamp."""

    def __post_init__(self) -> None:
        _check(self.tau_pos > 0 and self.tau_neg > 0,
               f"tau_pos and tau_neg must be > 0, got {self.tau_pos}, {self.tau_neg}")


@dataclass
class GMPOConfig:
    """Options of ``gmpo``."""

    clip_low: float = 0.4
    """Log-ratio lower clip (for A < 0): log r >= -clip_low (paper: ratio range (e^-0.4, e^0.4))."""
    clip_high: float = 0.4
    """Log-ratio upper clip (for A > 0): log r <= clip_high."""

    def __post_init__(self) -> None:
        _check(self.clip_low >= 0 and self.clip_high >= 0,
               f"clip_low and clip_high must be >= 0, got {self.clip_low}, {self.clip_high}")


@dataclass
class GPGConfig:
    """Options of ``gpg`` (none)."""


@dataclass
class ReinforceTISConfig:
    """Options of ``reinforce_tis``."""

    is_threshold: Optional[float] = 2.0
    """Truncation C of the importance weight, w = min(pi/pi_old, C); None = no truncation."""
    is_level: str = "token"
    """token: one weight per token; sequence: exp(sum of the sequence's log-ratios) on every token."""

    def __post_init__(self) -> None:
        if self.is_level not in IS_LEVELS:
            raise ConfigError(f"is_level: invalid value {self.is_level!r}. Valid choices: {', '.join(IS_LEVELS)}.")
        _check(self.is_threshold is None or self.is_threshold > 0,
               f"is_threshold must be positive or null, got {self.is_threshold}")


@dataclass
class VESPOConfig:
    """Options of ``vespo`` (defaults: TRL's, the paper's c1 and c2 of section 3.4)."""

    k_pos: float = 2.0
    """Power k of the weight w^k e^{lambda (1 - w)} for A >= 0: how fast sequences with w < 1 are down-weighted."""
    lambda_pos: float = 3.0
    """Decay lambda for A >= 0: how fast sequences with w > 1 are down-weighted."""
    k_neg: float = 3.0
    """Power k for A < 0."""
    lambda_neg: float = 2.0
    """Decay lambda for A < 0."""

    def __post_init__(self) -> None:
        _check(self.k_pos >= 0 and self.k_neg >= 0, f"k_pos and k_neg must be >= 0, got {self.k_pos}, {self.k_neg}")
        _check(self.lambda_pos > 0 and self.lambda_neg > 0,
               f"lambda_pos and lambda_neg must be > 0, got {self.lambda_pos}, {self.lambda_neg}")


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, clamp: float | None) -> torch.Tensor:
    log_ratio = logprobs - old_logprobs.detach()
    return log_ratio if clamp is None else log_ratio.clamp(-clamp, clamp)


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped loss ``max(-A r, -A clip(r, 1-lo, 1+hi))``, optionally dual-clipped.

    Returns ``(loss, clipped, dual_clipped)``: the per-token loss and two boolean indicators, the
    clipped branch strictly winning and the dual clip being active.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip_c is None:
        return loss, clip_active, torch.zeros_like(clip_active)
    cap = -advantages * dual_clip_c
    negative = advantages < 0
    dual_active = negative & (loss > cap)
    return torch.where(negative, torch.minimum(loss, cap), loss), clip_active, dual_active


def _finish(
    loss: torch.Tensor, response_mask: torch.Tensor, metrics: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = response_mask.to(loss.dtype)
    return loss * m, {name: value.detach().to(loss.dtype) * m for name, value in metrics.items()}


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: PPOClipConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with clip-higher and optional dual clip (see the module docstring)."""
    ratio = _log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp).exp()
    loss, clipped, dual = clipped_surrogate(
        ratio, advantages.detach(), cfg.clip_low, cfg.clip_high, cfg.dual_clip_c
    )
    return _finish(
        loss,
        response_mask,
        {"pg_clipfrac": clipped, "pg_clipfrac_lower": dual, "ppo_kl": old_logprobs - logprobs},
    )


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: GSPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token: the clipped surrogate on the sequence ratio, gradient routed per token."""
    sequence_log_ratio = masked_mean(logprobs.detach() - old_logprobs.detach(), response_mask, dim=-1)
    log_ratio = logprobs - logprobs.detach() + sequence_log_ratio[:, None]
    if cfg.log_ratio_max is not None:
        log_ratio = log_ratio.clamp(max=cfg.log_ratio_max)
    loss, clipped, _ = clipped_surrogate(log_ratio.exp(), advantages.detach(), cfg.clip_low, cfg.clip_high)
    return _finish(loss, response_mask, {"pg_clipfrac": clipped, "ppo_kl": old_logprobs - logprobs})


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: CISPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: REINFORCE weighted by the detached, clipped IS ratio ``-sg(w) A lp``."""
    ratio = _log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp).exp().detach()
    if cfg.mode == "bounded":
        weight = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    else:
        weight = ratio.clamp(max=cfg.eps_high)
    loss = -weight * advantages.detach() * logprobs
    return _finish(loss, response_mask, {"pg_clipfrac": weight != ratio, "ppo_kl": old_logprobs - logprobs})


def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: SAPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: the soft gate ``-A (4/tau) sigmoid(tau (r - 1))``."""
    ratio = _log_ratio(logprobs, old_logprobs, cfg.log_ratio_clamp).exp()
    advantages = advantages.detach()
    tau_pos, tau_neg = (torch.tensor(t, dtype=ratio.dtype, device=ratio.device) for t in (cfg.tau_pos, cfg.tau_neg))
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    loss = -advantages * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return _finish(loss, response_mask, {"ppo_kl": old_logprobs - logprobs})


def gmpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: GMPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: the geometric mean of the sign-aware clipped token ratios, times the sequence advantage."""
    m = response_mask.to(logprobs.dtype)
    advantages = advantages.detach()
    log_ratio = logprobs - old_logprobs.detach()
    clamped = log_ratio.clamp(-cfg.clip_low, cfg.clip_high)
    sign = torch.sign(advantages)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped)
    length = m.sum(-1).clamp(min=1)
    sequence_ratio = torch.exp((clipped_log_ratio * m).sum(-1) / length)
    sequence_advantage = (advantages * m).sum(-1) / length
    loss = (-sequence_advantage * sequence_ratio)[:, None].expand_as(logprobs)
    outside = log_ratio.detach() != clamped.detach()
    return _finish(loss, response_mask, {
        "pg_clipfrac": outside & (advantages > 0),
        "pg_clipfrac_lower": outside & (advantages < 0),
        "ppo_kl": old_logprobs - logprobs,
    })


def gpg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: GPGConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG: ``-A lp``."""
    return _finish(-advantages.detach() * logprobs, response_mask, {"ppo_kl": old_logprobs - logprobs})


def reinforce_tis_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: ReinforceTISConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE weighted by the detached, truncated importance weight ``-sg(min(pi/pi_old, C)) A lp``."""
    m = response_mask.to(logprobs.dtype)
    log_weight = (logprobs.detach() - old_logprobs.detach()) * m
    if cfg.is_level == "sequence":
        log_weight = log_weight.sum(-1, keepdim=True).expand_as(logprobs)
    raw = log_weight.clamp(-20.0, 20.0).exp()
    weight = raw if cfg.is_threshold is None else raw.clamp(max=cfg.is_threshold)
    loss = -weight * advantages.detach() * logprobs
    return _finish(loss, response_mask, {
        "ppo_kl": old_logprobs - logprobs, "is_weight_mean": weight, "is_truncated_frac": weight != raw,
    })


VESPO_MIN_LOG_WEIGHT = math.log(1e-8)
"""Lower clamp of the sequence log-weight (TRL's, from VESPO's reference code)."""


def vespo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: VESPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO: REINFORCE weighted by the detached Gamma kernel of the sequence IS weight ``-sg(phi(w_i)) A lp``."""
    m = response_mask.to(logprobs.dtype)
    advantages = advantages.detach()
    token_log_ratio = (logprobs.detach() - old_logprobs.detach()).clamp(-20.0, 20.0)
    log_weight = (token_log_ratio * m).sum(-1, keepdim=True).clamp(VESPO_MIN_LOG_WEIGHT, 20.0)
    nonnegative = advantages >= 0
    k = torch.where(nonnegative, torch.full_like(log_weight, cfg.k_pos), cfg.k_neg)  # [B, T]: the sign is A's
    decay = torch.where(nonnegative, torch.full_like(log_weight, cfg.lambda_pos), cfg.lambda_neg)
    phi = torch.exp(decay + k * log_weight - decay * log_weight.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = -phi * advantages * logprobs
    return _finish(loss, response_mask, {"ppo_kl": old_logprobs - logprobs, "vespo_phi_mean": phi})


@hookimpl
def register_policy_losses(register: Register) -> None:
    # each with its float64 reference (end of this module), which rlite audit and rlite.testing.conformance check it against
    register("ppo_clip", ppo_clip_loss, PPOClipConfig, reference=ppo_clip_reference)
    register("gspo", gspo_loss, GSPOConfig, reference=gspo_reference)
    register("cispo", cispo_loss, CISPOConfig, reference=cispo_reference)
    register("sapo", sapo_loss, SAPOConfig, reference=sapo_reference)
    register("gmpo", gmpo_loss, GMPOConfig, reference=gmpo_reference)
    register("gpg", gpg_loss, GPGConfig, reference=gpg_reference)
    register("reinforce_tis", reinforce_tis_loss, ReinforceTISConfig, reference=reinforce_tis_reference)
    register("vespo", vespo_loss, VESPOConfig, reference=vespo_reference)


# --------------------------------------------------------------------------------------------------
# float64 references: the formulas of the module docstring again, as plain loops over Python floats,
# registered with each loss (``reference=``) for ``rlite audit`` and ``rlite.testing.conformance``. Each takes the
# loss's arguments and returns the [B, T] per-token loss, 0 where the mask is 0.
# --------------------------------------------------------------------------------------------------


def _clamp(value: float, bound: float | None) -> float:
    return value if bound is None else min(max(value, -bound), bound)


def _token_reference(per_token) -> Callable:
    """A reference from ``per_token(x, A, lp, sequence_log_ratio, cfg)`` (``x`` = lp - old of the token,
    the sequence's sum of ``x`` over its response tokens)."""

    def reference(logprobs, old_logprobs, advantages, response_mask, cfg) -> torch.Tensor:
        lp, old, adv = logprobs.double().tolist(), old_logprobs.double().tolist(), advantages.double().tolist()
        mask = response_mask.bool().tolist()
        out = torch.zeros(len(lp), len(lp[0]), dtype=torch.float64)
        for i, row in enumerate(mask):
            sequence = sum(lp[i][t] - old[i][t] for t, keep in enumerate(row) if keep)
            for t, keep in enumerate(row):
                if keep:
                    out[i, t] = per_token(lp[i][t] - old[i][t], adv[i][t], lp[i][t], sequence, cfg)
        return out

    return reference


def _ppo_clip_token(x, a, lp, sequence, cfg: PPOClipConfig) -> float:
    r = math.exp(_clamp(x, cfg.log_ratio_clamp))
    loss = max(-a * r, -a * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high))
    return min(loss, -cfg.dual_clip_c * a) if cfg.dual_clip_c is not None and a < 0 else loss


def _cispo_token(x, a, lp, sequence, cfg: CISPOConfig) -> float:
    r = math.exp(_clamp(x, cfg.log_ratio_clamp))
    w = min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high) if cfg.mode == "bounded" else min(r, cfg.eps_high)
    return -w * a * lp


def _sapo_token(x, a, lp, sequence, cfg: SAPOConfig) -> float:
    r = math.exp(_clamp(x, cfg.log_ratio_clamp))
    tau = cfg.tau_pos if a > 0 else cfg.tau_neg
    return -a * 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))


def _reinforce_tis_token(x, a, lp, sequence, cfg: ReinforceTISConfig) -> float:
    w = math.exp(_clamp(x if cfg.is_level == "token" else sequence, 20.0))
    return -(w if cfg.is_threshold is None else min(w, cfg.is_threshold)) * a * lp


ppo_clip_reference = _token_reference(_ppo_clip_token)
cispo_reference = _token_reference(_cispo_token)
sapo_reference = _token_reference(_sapo_token)
gpg_reference = _token_reference(lambda x, a, lp, sequence, cfg: -a * lp)
reinforce_tis_reference = _token_reference(_reinforce_tis_token)


def _sequence_reference(per_sequence) -> Callable:
    """A reference from ``per_sequence(xs, As, lps, cfg) -> [loss of each token]`` over one sequence's
    response tokens (their log-ratios, advantages and log-probs)."""

    def reference(logprobs, old_logprobs, advantages, response_mask, cfg) -> torch.Tensor:
        lp, old, adv = logprobs.double().tolist(), old_logprobs.double().tolist(), advantages.double().tolist()
        out = torch.zeros(len(lp), len(lp[0]), dtype=torch.float64)
        for i, row in enumerate(response_mask.bool().tolist()):
            tokens = [t for t, keep in enumerate(row) if keep]
            losses = per_sequence([lp[i][t] - old[i][t] for t in tokens], [adv[i][t] for t in tokens],
                                  [lp[i][t] for t in tokens], cfg)
            for t, loss in zip(tokens, losses):
                out[i, t] = loss
        return out

    return reference


def _gspo_sequence(xs, advantages, lps, cfg: GSPOConfig) -> list[float]:
    log_s = sum(xs) / max(len(xs), 1)
    s = math.exp(log_s if cfg.log_ratio_max is None else min(log_s, cfg.log_ratio_max))
    return [max(-a * s, -a * min(max(s, 1 - cfg.clip_low), 1 + cfg.clip_high)) for a in advantages]


def _gmpo_sequence(xs, advantages, lps, cfg: GMPOConfig) -> list[float]:
    kept = 0.0
    for x, a in zip(xs, advantages):
        sign = (a > 0) - (a < 0)
        kept += sign * min(sign * x, sign * min(max(x, -cfg.clip_low), cfg.clip_high))
    n = max(len(xs), 1)
    return [-(sum(advantages) / n) * math.exp(kept / n)] * len(xs)


def _vespo_sequence(xs, advantages, lps, cfg: VESPOConfig) -> list[float]:
    log_w = sum(min(max(x, -20.0), 20.0) for x in xs)
    w = math.exp(min(max(log_w, math.log(1e-8)), 20.0))
    losses = []
    for a, lp in zip(advantages, lps):
        k, lam = (cfg.k_pos, cfg.lambda_pos) if a >= 0 else (cfg.k_neg, cfg.lambda_neg)
        losses.append(-(w**k) * math.exp(lam * (1.0 - w)) * a * lp)
    return losses


gspo_reference = _sequence_reference(_gspo_sequence)
gmpo_reference = _sequence_reference(_gmpo_sequence)
vespo_reference = _sequence_reference(_vespo_sequence)
