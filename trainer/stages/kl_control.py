"""KL to the reference model as a per-token reward penalty, and the controllers of its coefficient.

KL as a reward penalty (PPO / REINFORCE++ style, verl ``apply_kl_penalty``): per-token rewards
``-beta * kl * m`` added to the outcome (:func:`kl_reward_penalty`, no gradient), with beta fixed or
driven by :class:`AdaptiveKLController` (Ziegler et al. 2019)::

    e = clip(KL / target - 1, -0.2, 0.2),   beta <- beta * (1 + e * n / horizon)

where KL is the batch mean of per-sequence masked means (:func:`mean_sequence_kl`) and ``n`` the
number of samples since the last update.
"""

from __future__ import annotations

import torch

from rlite.config import KLConfig
from rlite.distributed import all_reduce_sum


def kl_reward_penalty(kl: torch.Tensor, coef: float, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards ``-coef * kl * mask`` (detached) to add to ``AdvantageInput.token_rewards``."""
    return -coef * kl.detach() * mask.to(kl.dtype)


def mean_sequence_kl(kl: torch.Tensor, mask: torch.Tensor) -> float:
    """The controller's KL: mean over sequences with at least one token of their masked mean KL."""
    m = mask.to(kl.dtype)
    count = m.sum(-1)
    has_tokens = count > 0
    if not bool(has_tokens.any()):
        return 0.0
    per_sequence = (kl.detach() * m).sum(-1)[has_tokens] / count[has_tokens]
    return float(per_sequence.mean())


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller of the KL coefficient towards a target KL."""

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be positive, got target={target}, horizon={horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move the coefficient after observing ``current_kl`` over ``n_steps`` samples; returns it."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])



class FixedKLController:
    """A constant KL-in-reward coefficient (same interface as the adaptive controller)."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


KLController = AdaptiveKLController | FixedKLController


def build_kl_controller(kl: KLConfig) -> KLController:
    if kl.adaptive_target is not None:
        return AdaptiveKLController(kl.coef, kl.adaptive_target, kl.adaptive_horizon)
    return FixedKLController(kl.coef)


def update_kl_controller(controller: KLController, kl: torch.Tensor, mask: torch.Tensor, group=None) -> float:
    """Feed this step's KL (global mean over sequences of their token mean, a collective over the
    data-parallel ``group``) to the
    controller; the coefficient it returns applies from the next step on. Returns the KL."""
    counts = mask.sum(-1)
    nonempty = counts > 0
    per_sequence = (kl * mask).sum(-1)[nonempty] / counts[nonempty]
    kl_sum, n = all_reduce_sum(torch.stack([per_sequence.sum(), nonempty.sum().to(kl.dtype)]), group).tolist()
    mean_kl = kl_sum / max(n, 1.0)
    controller.update(mean_kl, int(n))
    return mean_kl
