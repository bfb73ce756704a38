"""Built-in KL estimators (k1, k2, k3, abs, low_var_kl, k1+, k3+, abs+, low_var_kl+).

Per sampled token, with ``d = lp - ref`` (Schulman, "Approximating KL divergence", 2020), estimating
KL(pi_theta || pi_ref) from samples of pi_theta::

    k1 = d                       unbiased, can be negative; E[grad k1] = 0 on-policy
    k2 = d^2 / 2                 biased, >= 0; E[grad k2] = grad KL(pi || pi_ref)
    k3 = exp(-d) - 1 + d         unbiased, >= 0, low variance (GRPO paper); computed as expm1(-d) + d
    abs = |d|                    verl's "abs" (biased, >= 0; gradient sign(d))
    low_var_kl = clamp(exp(x) - x - 1, -10, 10),  x = clamp(-d, -20, 20)   (verl's "low_var_kl"/"k3")
    k1+, k3+, abs+ = k2 - sg(k2) + sg(base)  value of the base, gradient of k2 (verl's "+" variants)
    low_var_kl+ = k2 - sg(k2) + sg(low_var_kl)   verl's "k3+" / "low_var_kl+": the *clamped* value

``k3`` here is exact and unclamped (slime's k3, TRL); verl clamps its "k3" exactly like
``low_var_kl``, whose gradient is 0 wherever a clamp is active. So verl's "k3+" is rlite's
``low_var_kl+`` (value clamped to [-10, 10]), while rlite's ``k3+`` carries the exact k3 value; the
two differ only where |d| is large enough for a clamp (k3 > 10, i.e. d < -2.4 or d > 12.3 ...). As a loss term, E[grad k3] is the
gradient of the *forward* KL(pi_ref || pi) and E[grad k1] = 0, which is why the straight-through
variants exist. No estimator multiplies by an importance ratio for off-policy samples (TRL's
bias correction, slime's ``--use-unbiased-kl``): the trainer's estimators see only lp and ref.

KL as a reward penalty (and its adaptive coefficient) is core maths: :mod:`rlite.stages.kl_control`.
"""

from __future__ import annotations

import torch

from rlite.api import Register, hookimpl


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``lp - ref``."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``(lp - ref)^2 / 2``."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``exp(ref - lp) - 1 - (ref - lp)``, exact (no clamp)."""
    d = logprobs - ref_logprobs
    return torch.expm1(-d) + d


def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``|lp - ref|``."""
    return (logprobs - ref_logprobs).abs()


def kl_low_var(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """verl's ``low_var_kl``: k3 with the log-ratio clamped to +-20 and the value to [-10, 10]."""
    x = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.expm1(x) - x).clamp(-10.0, 10.0)


def _straight_through(
    value: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor
) -> torch.Tensor:
    k2 = kl_k2(logprobs, ref_logprobs)
    return k2 - k2.detach() + value.detach()


def kl_k1_plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Value of k1, gradient of k2."""
    return _straight_through(kl_k1(logprobs, ref_logprobs), logprobs, ref_logprobs)


def kl_k3_plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Value of k3, gradient of k2."""
    return _straight_through(kl_k3(logprobs, ref_logprobs), logprobs, ref_logprobs)


def kl_abs_plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Value of abs, gradient of k2."""
    return _straight_through(kl_abs(logprobs, ref_logprobs), logprobs, ref_logprobs)


def kl_low_var_plus(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Value of low_var_kl (clamped, verl's "k3+"), gradient of k2."""
    return _straight_through(kl_low_var(logprobs, ref_logprobs), logprobs, ref_logprobs)


@hookimpl
def register_kl_estimators(register: Register) -> None:
    register("k1", kl_k1)
    register("k2", kl_k2)
    register("k3", kl_k3)
    register("low_var_kl", kl_low_var)
    register("k1+", kl_k1_plus)
    register("k3+", kl_k3_plus)
    register("abs", kl_abs)
    register("abs+", kl_abs_plus)
    register("low_var_kl+", kl_low_var_plus)
