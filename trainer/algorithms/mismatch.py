"""Train/inference mismatch: what rlite measures, how corrections compose, and where π_old comes from.

Notation (as in ``docs/mismatch.md``): per response token ``t`` of sequence ``i``, ``train`` is the
trainer's log-prob of the sampled token (π_old, recomputed before the update), ``roll`` the log-prob
the rollout engine reported while sampling, ``m`` the response mask, ``d = train − roll`` and
``ρ = exp(d) = π_train / π_roll`` the token importance weight. "mean" over tokens is the masked
mean Σ x·m / Σ m; "mean over sequences" runs over the sequences with at least one valid token.

:func:`mismatch_metrics` (prefix ``mismatch/``):

======================  ====================================================================
``kl``                  mean_t (roll − train): the k1 estimate of KL(π_roll ‖ π_train) (verl's ``kl``)
``k3_kl``               mean_t (ρ − 1 − d): the k3 estimate of the same KL (≥ 0 per token)
``training_ppl``        mean_i exp(−mean_t train)
``rollout_ppl``         mean_i exp(−mean_t roll)
``log_ppl_diff``        mean_i (mean_t roll − mean_t train) = mean_i log(training_ppl_i / rollout_ppl_i)
``chi2_token``          mean_t ρ² − 1
``chi2_seq``            mean_i (Π_t ρ_t)² − 1, with Σ_t d clamped to ±20 as verl does
``ess``                 (mean_t ρ)² / mean_t ρ² = 1 / mean_t (ρ / mean ρ)², a fraction in (0, 1]
``max_abs_diff``        max_t |d|
``mean_abs_diff``       mean_t |d| (slime's ``train_rollout_logprob_abs_diff``)
``bitwise_equal_fraction``  fraction of valid tokens with train == roll exactly
======================  ====================================================================

Everything is computed in float64 on detached tensors; values outside the mask are never read (a
``-inf`` or NaN in padding is harmless). When the two tensors are equal every divergence is exactly
0, ``ess`` and ``bitwise_equal_fraction`` are exactly 1. With no valid token at all the divergences
are 0, ``ess`` and ``bitwise_equal_fraction`` are 1 and the perplexities are 1 (exp of an empty
sum). Departures from verl's ``compute_offpolicy_metrics``: sequence means skip fully masked rows
(verl averages them in as exp(0) = 1), per-token ρ is not clamped (float64 holds exp(±700)), and
``ess`` is reported on the raw token weights (verl reports it on the applied IS weights; the
corrections here report that one too, as ``rollout_is_eff_sample_size``).

:func:`compose_corrections` applies the corrections listed in ``algorithm.corrections`` in order.
Each one sees the mask left by the ones before it; weights multiply and masks intersect; the final
weights are zeroed outside the final mask. A correction function may declare any of the keyword
arguments ``weights`` (the running product of the weights so far, or None), ``advantages`` and
``logprobs`` (the current policy's log-probs, detached); only those it declares are passed.

:func:`resolve_old_logprobs` picks π_old for the PPO ratio: ``decoupled`` (default, verl's
three-policy form: ratio π_θ/π_old from the trainer's recomputation, times the correction weights
built from ρ = π_old/π_roll) or ``bypass`` (π_old := π_roll: no recomputation forward, the ratio
π_θ/π_roll already carries the mismatch). In bypass mode ρ ≡ 1, so the config loader refuses every
correction computed before the update (it would be a silent no-op); corrections that read the current
log-probs (OPSM) run at loss time against π_roll, and ``policy_loss: reinforce_tis`` truncates
π_θ/π_roll itself (verl's bypass REINFORCE).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

CorrectionOutput = tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]
"""What a correction returns: ``(weights [B, T] detached or None, mask [B, T], metrics)``."""

CorrectionFn = Callable[..., CorrectionOutput]
"""``fn(old_logprobs, rollout_logprobs, response_mask, cfg, *, weights=, advantages=, logprobs=)``."""

Correction = tuple[str, CorrectionFn, Any]
"""``(name, fn, cfg)``: one entry of ``algorithm.corrections``, resolved against the registry."""

SEQ_LOG_RATIO_BOUND = 20.0
"""Sequence log-ratios are clamped to ±this before exponentiation in ``chi2_seq`` (as verl)."""

OPTIONAL_CORRECTION_KWARGS = ("weights", "advantages", "logprobs")
"""Keyword arguments :func:`compose_corrections` passes to a correction only when it declares them."""


# --------------------------------------------------------------------------------------------------
# Small masked statistics shared with the correction plugins
# --------------------------------------------------------------------------------------------------


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def masked_log_ratio(numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``numerator − denominator`` where ``mask`` is set, exactly 0 elsewhere (padding never read)."""
    dtype = compute_dtype(numerator)
    diff = numerator.detach().to(dtype) - denominator.detach().to(dtype)
    return torch.where(mask.bool(), diff, torch.zeros((), dtype=dtype, device=diff.device))


def sequence_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] Σ_t x·m."""
    return (x * mask.to(x.dtype)).sum(-1)


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] Σ_t x·m / Σ_t m, 0 for a fully masked row."""
    return sequence_sum(x, mask) / mask.to(x.dtype).sum(-1).clamp(min=1)


def weight_stats(values: torch.Tensor) -> dict[str, float]:
    """verl's IS-weight statistics over a 1-D tensor of applied weights (one per token or sequence).

    ``rollout_is_eff_sample_size`` = (mean w)² / mean w²; 1.0 when there is no value at all, 0.0
    when every weight is zero.
    """
    values = values.detach().double()
    if values.numel() == 0:
        return {
            "rollout_is_mean": 0.0,
            "rollout_is_max": 0.0,
            "rollout_is_min": 0.0,
            "rollout_is_std": 0.0,
            "rollout_is_eff_sample_size": 1.0,
        }
    mean = values.mean()
    second = values.square().mean()
    ess = (mean.square() / second).item() if second > 0 else 0.0
    return {
        "rollout_is_mean": mean.item(),
        "rollout_is_max": values.max().item(),
        "rollout_is_min": values.min().item(),
        "rollout_is_std": values.std(unbiased=False).item(),
        "rollout_is_eff_sample_size": ess,
    }


def fraction(count: torch.Tensor | float, total: torch.Tensor | float) -> float:
    """count / total as a float, 0.0 when total is 0."""
    total = float(total)
    return float(count) / total if total > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------


def mismatch_metrics(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Divergence between the trainer's and the engine's log-probs of the sampled tokens.

    :param train_logprobs: [B, T] log π_train of the sampled tokens (π_old in decoupled mode).
    :param rollout_logprobs: [B, T] log π_roll reported by the engine.
    :param response_mask: [B, T] 1 for the tokens that count.
    :returns: ``mismatch/<name> -> value`` for the names in the module docstring.
    """
    valid = response_mask.detach().bool()
    zero = torch.zeros((), dtype=torch.float64, device=valid.device)
    train = torch.where(valid, train_logprobs.detach().double(), zero)
    roll = torch.where(valid, rollout_logprobs.detach().double(), zero)
    m = valid.double()
    n_tok = m.sum()
    lengths = m.sum(-1)
    has_tokens = lengths > 0

    if n_tok == 0:
        metrics = dict.fromkeys(
            ("kl", "k3_kl", "log_ppl_diff", "chi2_token", "chi2_seq", "max_abs_diff", "mean_abs_diff"), 0.0
        )
        metrics.update(training_ppl=1.0, rollout_ppl=1.0, ess=1.0, bitwise_equal_fraction=1.0)
        return {f"mismatch/{k}": v for k, v in metrics.items()}

    d = train - roll  # 0 outside the mask
    rho = torch.exp(d)
    mean_train = train.sum(-1)[has_tokens] / lengths[has_tokens]
    mean_roll = roll.sum(-1)[has_tokens] / lengths[has_tokens]
    seq_log_ratio = d.sum(-1)[has_tokens].clamp(-SEQ_LOG_RATIO_BOUND, SEQ_LOG_RATIO_BOUND)
    rho_mean = (rho * m).sum() / n_tok
    rho_sq_mean = (rho.square() * m).sum() / n_tok
    equal = (train_logprobs.detach() == rollout_logprobs.detach()) & valid

    metrics = {
        "kl": ((roll - train) * m).sum() / n_tok,
        "k3_kl": ((rho - 1.0 - d) * m).sum() / n_tok,
        "training_ppl": torch.exp(-mean_train).mean(),
        "rollout_ppl": torch.exp(-mean_roll).mean(),
        "log_ppl_diff": (mean_roll - mean_train).mean(),
        "chi2_token": rho_sq_mean - 1.0,
        "chi2_seq": torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
        "ess": rho_mean.square() / rho_sq_mean,
        "max_abs_diff": d.abs().max(),
        "mean_abs_diff": d.abs().sum() / n_tok,
        "bitwise_equal_fraction": equal.sum().double() / n_tok,
    }
    return {f"mismatch/{k}": float(v) for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------------
# Composition of corrections
# --------------------------------------------------------------------------------------------------


def declared_kwargs(fn: Callable[..., Any]) -> set[str]:
    """Which of :data:`OPTIONAL_CORRECTION_KWARGS` ``fn`` accepts (all of them if it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return set(OPTIONAL_CORRECTION_KWARGS)
    return {name for name in OPTIONAL_CORRECTION_KWARGS if name in params}


def needs_current_logprobs(corrections: Sequence[Correction]) -> bool:
    """True when some correction declares ``logprobs`` (then the trainer must call
    :func:`compose_corrections` per micro-batch, at loss time, with the detached current log-probs)."""
    return any("logprobs" in declared_kwargs(fn) for _, fn, _ in corrections)


def _metric_names(corrections: Sequence[Correction]) -> list[str]:
    """``name``, or ``name.<position>`` when the same name is listed more than once."""
    names = [name for name, _, _ in corrections]
    return [f"{name}.{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def compose_corrections(
    corrections: Sequence[Correction],
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    advantages: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
) -> CorrectionOutput:
    """Apply ``corrections`` in the declared order.

    Correction ``k`` is called with the mask left by corrections ``< k`` (so statistics such as a
    batch mean only see kept tokens) and, if it declares ``weights``, with the running product of
    the weights so far. Its weights multiply into the running product (None means all ones) and its
    mask intersects the running mask.

    :param corrections: ``(name, fn, cfg)`` triples, e.g. from :func:`build_corrections`.
    :param old_logprobs: [B, T] π_old log-probs (after :func:`resolve_old_logprobs`).
    :param rollout_logprobs: [B, T] engine log-probs.
    :param response_mask: [B, T] response mask; the returned mask has its dtype.
    :param advantages: [B] or [B, T] advantages, passed to corrections declaring ``advantages``.
    :param logprobs: [B, T] current log-probs, detached here, passed to corrections declaring ``logprobs``.
    :returns: ``(weights or None, mask, metrics)``; weights are detached and 0 outside the mask,
        metric names are ``correction/<name>/<metric>``.
    """
    mask = response_mask.detach()
    weights: torch.Tensor | None = None
    metrics: dict[str, float] = {}
    available = {
        "advantages": None if advantages is None else advantages.detach(),
        "logprobs": None if logprobs is None else logprobs.detach(),
    }
    for metric_name, (_, fn, cfg) in zip(_metric_names(corrections), corrections):
        wanted = declared_kwargs(fn)
        kwargs = {key: value for key, value in available.items() if key in wanted}
        if "weights" in wanted:
            kwargs["weights"] = weights
        new_weights, new_mask, new_metrics = fn(old_logprobs, rollout_logprobs, mask, cfg, **kwargs)
        mask = torch.logical_and(mask.bool(), new_mask.detach().bool()).to(response_mask.dtype)
        if new_weights is not None:
            new_weights = new_weights.detach()
            weights = new_weights if weights is None else weights * new_weights
        metrics.update({f"correction/{metric_name}/{k}": float(v) for k, v in new_metrics.items()})
    if weights is not None:
        weights = weights * mask.to(weights.dtype)
    return weights, mask, metrics


def build_corrections(choices: Sequence[Any], registry: Any) -> list[Correction]:
    """Resolve ``algorithm.corrections`` (validated :class:`rlite.config.Choice` items) against the
    ``mismatch_correction`` registry into ``(name, fn, cfg)`` triples, building each config instance as the
    config loader checked it (the registry's ``resolve``, :meth:`rlite.plugin_manager.Registry.resolve`)."""
    built = []
    for index, choice in enumerate(choices):
        fn, cfg = registry.resolve(choice, key=f"{registry.config_key}[{index}]")
        built.append((choice.name, fn, cfg))
    return built


# --------------------------------------------------------------------------------------------------
# Decoupled vs bypass
# --------------------------------------------------------------------------------------------------


def _decoupled(old_logprobs: torch.Tensor | None, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    if old_logprobs is None:
        raise ValueError(
            "old-logprob mode 'decoupled' needs the trainer's recomputed old log-probs; "
            "compute them before the update or use mode 'bypass'"
        )
    return old_logprobs


def _bypass(old_logprobs: torch.Tensor | None, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    return rollout_logprobs


@dataclass(frozen=True)
class OldLogprobMode:
    """One way of choosing π_old: whether the trainer recomputes log-probs for it, and the choice."""

    recomputes: bool
    resolve: Callable[[Optional[torch.Tensor], torch.Tensor], torch.Tensor]


OLD_LOGPROB_MODES: dict[str, OldLogprobMode] = {
    "decoupled": OldLogprobMode(recomputes=True, resolve=_decoupled),
    "bypass": OldLogprobMode(recomputes=False, resolve=_bypass),
}
"""How π_old is chosen; ``decoupled`` is the default."""


def resolve_old_logprobs(
    mode: str, old_logprobs: torch.Tensor | None, rollout_logprobs: torch.Tensor
) -> torch.Tensor:
    """π_old for the PPO ratio and for the corrections.

    * ``decoupled``: the trainer's recomputed log-probs. PPO ratio exp(lp − old); corrections weight
      by functions of ρ = exp(old − roll). Three policies, as verl's decoupled mode.
    * ``bypass``: the engine's log-probs (old := roll). The trainer can skip the recomputation
      forward; the PPO ratio exp(lp − roll) clips the mismatch together with the policy change, and
      corrections built on ρ would see ρ ≡ 1, so the config loader refuses them. slime's
      ``--use-rollout-logprobs``, verl's bypass.
    """
    try:
        resolve = OLD_LOGPROB_MODES[mode].resolve
    except KeyError:
        raise ValueError(
            f"unknown old-logprob mode {mode!r}. Valid choices: {', '.join(OLD_LOGPROB_MODES)}."
        ) from None
    return resolve(old_logprobs, rollout_logprobs)


def log_or_neg_inf(x: float | None) -> float:
    """log(x), −inf for None or 0 (an absent lower bound)."""
    return math.log(x) if x else -math.inf
