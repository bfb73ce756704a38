"""KL estimators, their gradients, the adaptive controller and the reward penalty, by hand in float64."""

from __future__ import annotations

import math

import pytest
import torch

from rlite.plugins import kl as K
from rlite.stages import kl_control as KC

torch.set_num_threads(1)

# d = lp - ref, including the extremes +-50 and values either side of verl's +-20 / [-10, 10] clamps
D = [0.0, 1e-9, 0.3, -0.3, 2.0, -2.0, 3.0, -3.0, 12.0, -12.0, 25.0, -25.0, 50.0, -50.0]
REF = [-0.5 - 0.1 * j for j in range(len(D))]


def inputs():
    ref = torch.tensor([REF], dtype=torch.float64)
    logprobs = (ref + torch.tensor([D], dtype=torch.float64)).requires_grad_(True)
    return logprobs, ref


def hand_k3(d: float) -> float:
    return math.expm1(-d) + d


def hand_low_var(d: float) -> float:
    x = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


HAND_VALUE = {
    "k1": lambda d: d,
    "k2": lambda d: 0.5 * d * d,
    "k3": hand_k3,
    "low_var_kl": hand_low_var,
    "k1+": lambda d: d,
    "k3+": hand_k3,
    "abs": abs,
    "abs+": abs,
    "low_var_kl+": hand_low_var,
}


def hand_low_var_grad(d: float) -> float:
    x = -d
    if abs(x) > 20:
        return 0.0
    k = math.exp(x) - x - 1
    if abs(k) > 10:
        return 0.0
    return -(math.exp(x) - 1)  # d/dlp of exp(x) - x - 1 with x = ref - lp


HAND_GRAD = {
    "k1": lambda d: 1.0,
    "k2": lambda d: d,
    "k3": lambda d: 1.0 - math.exp(-d),
    "low_var_kl": hand_low_var_grad,
    "k1+": lambda d: d,  # gradient of k2
    "k3+": lambda d: d,
    "abs": lambda d: (d > 0) - (d < 0),
    "abs+": lambda d: d,
    "low_var_kl+": lambda d: d,
}


def registered() -> dict:
    out = {}
    K.register_kl_estimators(register=lambda name, fn, config_cls=None: out.__setitem__(name, fn))
    return out


def test_registered_names() -> None:
    assert set(registered()) == {"k1", "k2", "k3", "low_var_kl", "k1+", "k3+", "abs", "abs+", "low_var_kl+"}


def test_clamped_straight_through_differs_from_exact_only_beyond_the_clamp() -> None:
    """verl's "k3+" (rlite's low_var_kl+) and rlite's exact k3+ agree until k3 leaves [-10, 10]."""
    logprobs, ref = inputs()
    exact, clamped = K.kl_k3_plus(logprobs, ref), K.kl_low_var_plus(logprobs, ref)
    for j, d in enumerate(D):
        same = abs(hand_k3(d)) <= 10.0 and abs(d) <= 20.0
        assert (exact[0, j].item() == pytest.approx(clamped[0, j].item(), rel=1e-12)) == same, d


@pytest.mark.parametrize("name", sorted(HAND_VALUE))
def test_values_and_gradients(name: str) -> None:
    fn = registered()[name]
    logprobs, ref = inputs()
    value = fn(logprobs, ref)
    (grad,) = torch.autograd.grad(value.sum(), logprobs)
    for j, d in enumerate(D):
        assert value[0, j].item() == pytest.approx(HAND_VALUE[name](d), rel=1e-12, abs=1e-15), (name, d)
        assert grad[0, j].item() == pytest.approx(HAND_GRAD[name](d), rel=1e-12, abs=1e-15), (name, d)


def test_k3_is_exact_and_unclamped_while_low_var_kl_clamps() -> None:
    logprobs, ref = inputs()
    k3 = K.kl_k3(logprobs, ref)
    assert k3[0, D.index(-50.0)].item() == pytest.approx(math.exp(50.0) - 51.0, rel=1e-12)
    assert K.kl_low_var(logprobs, ref)[0, D.index(-50.0)].item() == 10.0
    assert (k3 >= 0).all()
    assert k3[0, 1].item() == pytest.approx(0.5e-18, rel=1e-6)  # expm1 keeps tiny values accurate


def test_straight_through_values_are_bitwise_the_base() -> None:
    generator = torch.Generator().manual_seed(0)
    ref = -torch.rand(3, 9, generator=generator) * 4
    logprobs = ref + torch.randn(3, 9, generator=generator)
    assert torch.equal(K.kl_k1_plus(logprobs, ref), K.kl_k1(logprobs, ref))
    assert torch.equal(K.kl_k3_plus(logprobs, ref), K.kl_k3(logprobs, ref))


def test_adaptive_controller_follows_ziegler() -> None:
    controller = KC.AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    expected = 0.1
    for kl, n in [(6.0, 256), (9.0, 256), (100.0, 512), (0.0, 128), (5.4, 64)]:
        error = min(max(kl / 6.0 - 1.0, -0.2), 0.2)
        expected *= 1 + error * n / 10000
        assert controller.update(kl, n) == pytest.approx(expected, rel=1e-15)
    state = controller.state_dict()
    fresh = KC.AdaptiveKLController(init_coef=1.0, target=6.0, horizon=10000)
    fresh.load_state_dict(state)
    assert fresh.value == controller.value
    with pytest.raises(ValueError):
        KC.AdaptiveKLController(0.1, target=0.0, horizon=1)


def test_kl_reward_penalty_and_sequence_mean() -> None:
    kl = torch.tensor([[0.5, 1.0, 2.0], [4.0, -1.0, 3.0], [7.0, 7.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    penalty = KC.kl_reward_penalty(kl, 0.05, mask)
    assert not penalty.requires_grad
    torch.testing.assert_close(
        penalty, torch.tensor([[-0.025, -0.05, 0.0], [-0.2, 0.0, -0.15], [0.0, 0.0, 0.0]])
    )
    # (0.75 + 3.5) / 2; the empty row is left out
    assert KC.mean_sequence_kl(kl, mask) == pytest.approx(2.125)
    assert KC.mean_sequence_kl(kl, torch.zeros(3, 3)) == 0.0
