"""Policy losses against per-token formulas written out with Python floats, and their gradients."""

from __future__ import annotations

import math

import pytest
import torch

from rlite.algorithms import aggregate_loss
from rlite.config import ConfigError
from rlite.plugins import policy_losses as P

torch.set_num_threads(1)

# Rows: moderate ratios on both sides of the clip range, on-policy tokens, extreme log-ratios (+-50),
# a fully masked row and an interior masked token.
LOG_RATIO = [
    [0.0, 0.1, -0.1, 0.3, -0.4, 0.25],
    [50.0, -50.0, 1.5, -1.5, 0.18, -0.18],
    [0.05, 0.0, 30.0, 0.0, 0.0, 0.0],
    [0.9, -0.9, 0.0, 2.0, -3.0, 0.2],
]
ADV = [
    [1.0, 1.0, 1.0, -1.0, -1.0, 0.0],
    [-2.0, 2.0, -1.0, 1.0, 0.5, -0.5],
    [1.5, -1.5, -0.7, 0.3, 0.0, 0.0],
    [-1.0, -1.0, 2.0, -0.5, 0.5, 1.0],
]
MASK = [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 0, 1, 1, 1]]
OLD = [[-1.0 - 0.1 * t - 0.2 * i for t in range(6)] for i in range(4)]


def inputs(requires_grad: bool = True):
    old = torch.tensor(OLD, dtype=torch.float64)
    logprobs = (old + torch.tensor(LOG_RATIO, dtype=torch.float64)).requires_grad_(requires_grad)
    return logprobs, old, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK)


def cells():
    for i in range(len(MASK)):
        for t in range(len(MASK[0])):
            yield i, t


def hand_ppo(log_ratio: float, adv: float, lo: float, hi: float, c: float | None, clamp: float | None):
    """Returns (loss, d loss / d lp, clipped, dual) for one token."""
    lr = log_ratio if clamp is None else min(max(log_ratio, -clamp), clamp)
    clamped_away = clamp is not None and abs(log_ratio) > clamp
    r = math.exp(lr)
    l1 = -adv * r
    l2 = -adv * min(max(r, 1 - lo), 1 + hi)
    loss = max(l1, l2)
    clipped = l2 > l1
    grad = 0.0 if clipped or clamped_away else -adv * r
    dual = False
    if c is not None and adv < 0:
        dual = loss > -c * adv
        if dual:
            loss, grad = -c * adv, 0.0
    return loss, grad, clipped, dual


@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
@pytest.mark.parametrize("clamp", [20.0, None])
@pytest.mark.parametrize(("lo", "hi"), [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_values_metrics_and_gradient(dual_clip_c, clamp, lo, hi) -> None:
    logprobs, old, adv, mask = inputs()
    cfg = P.PPOClipConfig(clip_low=lo, clip_high=hi, dual_clip_c=dual_clip_c, log_ratio_clamp=clamp)
    loss, metrics = P.ppo_clip_loss(logprobs, old, adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    for i, t in cells():
        m = MASK[i][t]
        want, want_grad, clipped, dual = hand_ppo(LOG_RATIO[i][t], ADV[i][t], lo, hi, dual_clip_c, clamp)
        assert loss[i, t].item() == pytest.approx(want * m, rel=1e-12, abs=1e-12)
        assert grad[i, t].item() == pytest.approx(want_grad * m, rel=1e-12, abs=1e-12)
        assert metrics["pg_clipfrac"][i, t].item() == float(clipped and m)
        assert metrics["pg_clipfrac_lower"][i, t].item() == float(dual and m)
        assert metrics["ppo_kl"][i, t].item() == pytest.approx(-LOG_RATIO[i][t] * m, abs=1e-12)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    assert all(not v.requires_grad for v in metrics.values())


def test_ppo_clip_extreme_log_ratio_is_finite_in_float32() -> None:
    _, old, adv, mask = inputs()
    offsets = torch.tensor([[100.0, -100.0, 0.0, 0.0, 0.0, 0.0]] * 4, dtype=torch.float64)
    logprobs = (old + offsets).float().requires_grad_(True)
    loss, _ = P.ppo_clip_loss(logprobs, old.float(), adv.float(), mask, P.PPOClipConfig())
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert (grad[:, :2] == 0).all()  # beyond the +-20 clamp


def test_on_policy_ratio_is_exactly_one() -> None:
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 7, generator=generator) * 5
    logprobs = old.clone().requires_grad_(True)
    adv = torch.randn(5, 7, generator=generator)
    mask = torch.ones(5, 7)
    for cfg in [P.PPOClipConfig(), P.PPOClipConfig(dual_clip_c=3.0, clip_high=0.28)]:
        loss, metrics = P.ppo_clip_loss(logprobs, old, adv, mask, cfg)
        assert torch.equal(loss, -adv)  # ratio == 1 bit for bit
        assert (metrics["pg_clipfrac"] == 0).all() and (metrics["pg_clipfrac_lower"] == 0).all()
        assert (metrics["ppo_kl"] == 0).all()
        (grad,) = torch.autograd.grad(loss.sum(), logprobs)
        assert torch.equal(grad, -adv)


# --------------------------------------------------------------------------------------------------
# GSPO
# --------------------------------------------------------------------------------------------------


def gspo_case():
    # per-sequence mean log-ratios chosen inside and outside [log(1-3e-4), log(1+4e-4)]
    old = torch.tensor(OLD, dtype=torch.float64)
    offsets = torch.tensor(
        [
            [1e-4, 2e-4, -1e-4, 1e-4, 0.0, 2e-4],  # mean 6.7e-5: inside
            [1e-3, 1e-3, 2e-3, 0.0, 1e-3, 1e-3],  # mean 1e-3: above
            [0.1, 0.1, 0.1, 0.1, 0.1, 0.1],  # masked
            [-1e-3, -2e-3, 50.0, -1e-3, -1e-3, -1e-3],  # masked 50 ignored: mean -1.2e-3, below
        ],
        dtype=torch.float64,
    )
    adv = torch.tensor([[1.0] * 6, [1.0] * 6, [2.0] * 6, [-1.0] * 6], dtype=torch.float64)
    return (old + offsets).requires_grad_(True), old, adv, torch.tensor(MASK)


def test_gspo_values_and_metrics() -> None:
    logprobs, old, adv, mask = gspo_case()
    loss, metrics = P.gspo_loss(logprobs, old, adv, mask, P.GSPOConfig())
    for i in range(4):
        kept = [t for t in range(6) if MASK[i][t]]
        diffs = [logprobs[i, t].item() - old[i, t].item() for t in kept]
        s = math.exp(sum(diffs) / len(diffs)) if kept else 1.0
        a = adv[i, 0].item()
        want = max(-a * s, -a * min(max(s, 1 - 3e-4), 1 + 4e-4))
        clipped = -a * min(max(s, 1 - 3e-4), 1 + 4e-4) > -a * s
        for t in range(6):
            m = MASK[i][t]
            assert loss[i, t].item() == pytest.approx(want * m, rel=1e-12, abs=1e-14)
            assert metrics["pg_clipfrac"][i, t].item() == float(clipped and m)
    assert metrics["pg_clipfrac"][0].sum() == 0 and metrics["pg_clipfrac"][1].sum() == 6
    assert metrics["pg_clipfrac"][3].sum() == 5


def test_gspo_gradient_equals_the_sequence_level_paper_gradient() -> None:
    logprobs, old, adv, mask = gspo_case()
    loss, _ = P.gspo_loss(logprobs, old, adv, mask, P.GSPOConfig())
    aggregated = aggregate_loss(
        loss, mask, "seq-mean-token-mean", global_tokens=mask.sum().item(), global_sequences=4
    )
    (grad_token_form,) = torch.autograd.grad(aggregated, logprobs)

    # The paper: J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(lp - old)), grad through s_i.
    m = mask.double()
    s = torch.exp(((logprobs - old) * m).sum(-1) / m.sum(-1).clamp(min=1))
    a = adv[:, 0]
    objective = torch.minimum(s * a, s.clamp(1 - 3e-4, 1 + 4e-4) * a)
    (grad_paper,) = torch.autograd.grad(-objective.mean(), logprobs)
    grad_paper = grad_paper * m  # a fully masked row's s does not depend on its (masked) tokens
    torch.testing.assert_close(grad_token_form, grad_paper, rtol=1e-12, atol=1e-15)
    assert grad_token_form[0].abs().sum() > 0 and (grad_token_form[1] == 0).all()


# --------------------------------------------------------------------------------------------------
# CISPO
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "eps_low", "eps_high"), [("bounded", 1.0, 4.0), ("bounded", 0.2, 0.28), ("absolute", 0.0, 5.0)]
)
def test_cispo_values_and_gradient(mode: str, eps_low: float, eps_high: float) -> None:
    logprobs, old, adv, mask = inputs()
    cfg = P.CISPOConfig(eps_low=eps_low, eps_high=eps_high, mode=mode)
    loss, metrics = P.cispo_loss(logprobs, old, adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    for i, t in cells():
        m = MASK[i][t]
        r = math.exp(min(max(LOG_RATIO[i][t], -20.0), 20.0))
        w = min(max(r, 1 - eps_low), 1 + eps_high) if mode == "bounded" else min(r, eps_high)
        lp = logprobs[i, t].item()
        assert loss[i, t].item() == pytest.approx(-w * ADV[i][t] * lp * m, rel=1e-12, abs=1e-12)
        # every token keeps its gradient, scaled by the clipped weight
        assert grad[i, t].item() == pytest.approx(-w * ADV[i][t] * m, rel=1e-12, abs=1e-12)
        assert metrics["pg_clipfrac"][i, t].item() == float((w != r) and m)


# --------------------------------------------------------------------------------------------------
# shared
# --------------------------------------------------------------------------------------------------


def test_registration_and_config_validation() -> None:
    registered = {}
    P.register_policy_losses(register=lambda n, fn, c=None, **meta: registered.__setitem__(n, (fn, c)))
    assert registered == {
        "ppo_clip": (P.ppo_clip_loss, P.PPOClipConfig),
        "gspo": (P.gspo_loss, P.GSPOConfig),
        "cispo": (P.cispo_loss, P.CISPOConfig),
        "sapo": (P.sapo_loss, P.SAPOConfig),
        "gmpo": (P.gmpo_loss, P.GMPOConfig),
        "gpg": (P.gpg_loss, P.GPGConfig),
        "reinforce_tis": (P.reinforce_tis_loss, P.ReinforceTISConfig),
        "vespo": (P.vespo_loss, P.VESPOConfig),
    }
    for bad in [
        lambda: P.PPOClipConfig(dual_clip_c=1.0),
        lambda: P.PPOClipConfig(clip_low=1.0),
        lambda: P.PPOClipConfig(log_ratio_clamp=0.0),
        lambda: P.GSPOConfig(clip_high=-1.0),
        lambda: P.CISPOConfig(mode="trl"),
        lambda: P.CISPOConfig(eps_high=0.0),
        lambda: P.SAPOConfig(tau_neg=0.0),
        lambda: P.GMPOConfig(clip_low=-0.1),
        lambda: P.ReinforceTISConfig(is_level="geometric"),
        lambda: P.ReinforceTISConfig(is_threshold=0.0),
        lambda: P.VESPOConfig(k_neg=-1.0),
        lambda: P.VESPOConfig(lambda_pos=0.0),
    ]:
        with pytest.raises(ConfigError):
            bad()


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "sapo", "gmpo", "gpg", "reinforce_tis", "vespo"])
def test_masked_tokens_give_zero_loss_metrics_and_gradient(name: str) -> None:
    registered = {}
    P.register_policy_losses(register=lambda n, fn, c=None, **meta: registered.__setitem__(n, (fn, c)))
    fn, config_cls = registered[name]
    logprobs, old, adv, mask = inputs()
    loss, metrics = fn(logprobs, old, adv, mask, config_cls())
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    outside = mask == 0
    assert loss.shape == (4, 6) and torch.isfinite(loss).all()
    assert (loss[outside] == 0).all() and (grad[outside] == 0).all()
    for value in metrics.values():
        assert value.shape == (4, 6) and (value[outside] == 0).all()


# --------------------------------------------------------------------------------------------------
# SAPO, GMPO, GPG, REINFORCE with truncated IS
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tau_pos", "tau_neg"), [(1.0, 1.05), (2.0, 0.5)])
def test_sapo_soft_gate_values_and_gradient(tau_pos, tau_neg) -> None:
    logprobs, old, adv, mask = inputs()
    loss, metrics = P.sapo_loss(logprobs, old, adv, mask, P.SAPOConfig(tau_pos=tau_pos, tau_neg=tau_neg))
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    for i, t in cells():
        m = MASK[i][t]
        a, x = ADV[i][t], LOG_RATIO[i][t]
        r = math.exp(min(max(x, -20.0), 20.0))
        tau = tau_pos if a > 0 else tau_neg
        sigma = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
        want = -a * sigma * 4.0 / tau
        want_grad = 0.0 if abs(x) > 20 else -a * 4.0 * sigma * (1.0 - sigma) * r
        assert loss[i, t].item() == pytest.approx(want * m, rel=1e-12, abs=1e-12)
        assert grad[i, t].item() == pytest.approx(want_grad * m, rel=1e-9, abs=1e-12)
        assert metrics["ppo_kl"][i, t].item() == pytest.approx(-x * m, abs=1e-12)


def test_sapo_on_policy_gradient_equals_ppo() -> None:
    _, old, adv, mask = inputs()
    logprobs = old.clone().requires_grad_(True)
    loss, _ = P.sapo_loss(logprobs, old, adv, mask, P.SAPOConfig())
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    torch.testing.assert_close(grad, -adv * mask, rtol=1e-12, atol=1e-12)  # 4 sigma(0)(1 - sigma(0)) = 1
    tau = torch.where(adv > 0, torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.05, dtype=torch.float64))
    torch.testing.assert_close(loss, -adv * 2.0 / tau * mask, rtol=1e-12, atol=1e-12)  # gate 2/tau at r = 1


@pytest.mark.parametrize(("lo", "hi"), [(0.4, 0.4), (0.2, 0.28)])
def test_gmpo_geometric_mean_with_sign_aware_log_clip(lo, hi) -> None:
    logprobs, old, adv, mask = inputs()
    loss, metrics = P.gmpo_loss(logprobs, old, adv, mask, P.GMPOConfig(clip_low=lo, clip_high=hi))
    lengths = [sum(row) for row in MASK]
    per_sequence = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # = l_i on each row
    (grad,) = torch.autograd.grad(per_sequence.sum(), logprobs)
    for i in range(4):
        n = max(lengths[i], 1)
        kept, passes = 0.0, []
        for t in range(6):
            x, a = LOG_RATIO[i][t], ADV[i][t]
            clamped = min(max(x, -lo), hi)
            sign = (a > 0) - (a < 0)
            chosen = sign * min(sign * x, sign * clamped)
            kept += chosen * MASK[i][t]
            passes.append(float(sign != 0 and chosen == x))
            out = x != clamped
            assert metrics["pg_clipfrac"][i, t].item() == float(out and a > 0 and MASK[i][t])
            assert metrics["pg_clipfrac_lower"][i, t].item() == float(out and a < 0 and MASK[i][t])
        s = math.exp(kept / n)
        a_i = sum(ADV[i][t] * MASK[i][t] for t in range(6)) / n
        want = -a_i * s
        for t in range(6):
            assert loss[i, t].item() == pytest.approx(want * MASK[i][t], rel=1e-12, abs=1e-12)
            assert grad[i, t].item() == pytest.approx(-a_i * s / n * passes[t] * MASK[i][t], rel=1e-12, abs=1e-12)
    # seq-mean-token-mean aggregation gives verl's plain mean of l_i over all sequences (empty rows count)
    agg = aggregate_loss(loss.detach(), mask, "seq-mean-token-mean", global_tokens=mask.sum().item(), global_sequences=4)
    assert agg.item() == pytest.approx(per_sequence.sum().item() / 4, rel=1e-12)


def test_gpg_loss_is_plain_policy_gradient() -> None:
    logprobs, old, adv, mask = inputs()
    loss, metrics = P.gpg_loss(logprobs, old, adv, mask, P.GPGConfig())
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    torch.testing.assert_close(loss, (-adv * logprobs * mask).detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, -adv * mask, rtol=1e-12, atol=1e-12)
    assert set(metrics) == {"ppo_kl"}


@pytest.mark.parametrize("threshold", [2.0, None])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reinforce_truncated_is(threshold, level) -> None:
    logprobs, old, adv, mask = inputs()
    cfg = P.ReinforceTISConfig(is_threshold=threshold, is_level=level)
    loss, metrics = P.reinforce_tis_loss(logprobs, old, adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    for i, t in cells():
        m = MASK[i][t]
        if level == "token":
            log_w = LOG_RATIO[i][t]
        else:
            log_w = sum(LOG_RATIO[i][u] * MASK[i][u] for u in range(6))
        raw = math.exp(min(max(log_w, -20.0), 20.0))
        w = raw if threshold is None else min(raw, threshold)
        lp = logprobs[i, t].item()
        assert loss[i, t].item() == pytest.approx(-w * ADV[i][t] * lp * m, rel=1e-12, abs=1e-12)
        assert grad[i, t].item() == pytest.approx(-w * ADV[i][t] * m, rel=1e-12, abs=1e-12)
        assert metrics["is_weight_mean"][i, t].item() == pytest.approx(w * m, rel=1e-12)
        assert metrics["is_truncated_frac"][i, t].item() == float(w != raw and m)
    # on-policy: weight exactly 1, the loss is -A lp
    on_policy = old.clone().requires_grad_(True)
    loss, metrics = P.reinforce_tis_loss(on_policy, old, adv, mask, cfg)
    assert torch.equal(metrics["is_weight_mean"], mask.double())


# --------------------------------------------------------------------------------------------------
# VESPO
# --------------------------------------------------------------------------------------------------

# Rows: a small positive sequence log-ratio; tokens beyond +-20 whose clamped sum (-0.1) differs from the
# plain sum (4.4); a fully masked row; mixed-sign advantages with a masked 40 inside; a sum below log(1e-8);
# a ratio above 1 under a negative advantage.
VESPO_LOG_RATIO = [
    [0.1, 0.2, -0.05, 0.0, 0.1, 0.05],
    [25.0, -20.5, 0.1, -0.2, 0.0, 0.0],
    [0.3, 0.3, 0.3, 0.3, 0.3, 0.3],
    [-0.3, -0.2, 40.0, -0.4, -0.1, 0.0],
    [-10.0, -10.0, -10.0, -5.0, 0.0, 0.0],
    [0.2, 0.1, 0.2, 0.0, 0.0, 0.0],
]
VESPO_ADV = [[1.0] * 6, [-1.5] * 6, [1.0] * 6, [1.0, -1.0, 2.0, 0.0, -0.5, 0.5], [2.0] * 6, [-1.0] * 6]
VESPO_MASK = [[1] * 6, [1] * 6, [0] * 6, [1, 1, 0, 1, 1, 1], [1] * 6, [1, 1, 1, 0, 0, 0]]


def hand_vespo_weight(row: int, adv: float, cfg) -> float:
    """TRL's get_gamma_weights for one token: w^k e^{lambda (1 - w)} of the clamped sequence weight."""
    total = sum(min(max(x, -20.0), 20.0) * m for x, m in zip(VESPO_LOG_RATIO[row], VESPO_MASK[row]))
    log_w = min(max(total, math.log(1e-8)), 20.0)
    k, lam = (cfg.k_pos, cfg.lambda_pos) if adv >= 0 else (cfg.k_neg, cfg.lambda_neg)
    w = math.exp(log_w)
    return w**k * math.exp(lam * (1.0 - w))


@pytest.mark.parametrize("cfg", [P.VESPOConfig(), P.VESPOConfig(k_pos=0.5, lambda_pos=0.25, k_neg=1.3, lambda_neg=4.0)])
def test_vespo_gamma_weight_values_gradient_and_metrics(cfg) -> None:
    old = torch.tensor([[-1.0 - 0.1 * t - 0.2 * i for t in range(6)] for i in range(6)], dtype=torch.float64)
    logprobs = (old + torch.tensor(VESPO_LOG_RATIO, dtype=torch.float64)).requires_grad_(True)
    adv, mask = torch.tensor(VESPO_ADV, dtype=torch.float64), torch.tensor(VESPO_MASK)
    loss, metrics = P.vespo_loss(logprobs, old, adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    for i in range(6):
        for t in range(6):
            m, a = VESPO_MASK[i][t], VESPO_ADV[i][t]
            phi = hand_vespo_weight(i, a, cfg)
            lp = logprobs[i, t].item()
            assert loss[i, t].item() == pytest.approx(-phi * a * lp * m, rel=1e-12, abs=1e-300)
            assert grad[i, t].item() == pytest.approx(-phi * a * m, rel=1e-12, abs=1e-300)  # phi is detached
            assert metrics["vespo_phi_mean"][i, t].item() == pytest.approx(phi * m, rel=1e-12, abs=1e-300)
            assert metrics["ppo_kl"][i, t].item() == pytest.approx(-VESPO_LOG_RATIO[i][t] * m, abs=1e-12)
    assert set(metrics) == {"ppo_kl", "vespo_phi_mean"}
    # the clamps matter here: row 1 sums the clamped tokens to w = e^-0.1 (not e^4.4); row 4 sits at 1e-8
    assert metrics["vespo_phi_mean"][1, 0].item() > 0.5
    assert metrics["vespo_phi_mean"][4, 0].item() == pytest.approx(1e-8**cfg.k_pos * math.exp(cfg.lambda_pos), rel=1e-9)


def test_vespo_on_policy_weight_is_exactly_one_and_peaks_at_k_over_lambda() -> None:
    _, old, adv, mask = inputs()
    logprobs = old.clone().requires_grad_(True)
    loss, metrics = P.vespo_loss(logprobs, old, adv, mask, P.VESPOConfig())
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    assert torch.equal(metrics["vespo_phi_mean"], mask.double())  # phi(1) = e^{lam - lam} = 1 bit for bit
    assert torch.equal(grad, -adv * mask)  # on-policy VESPO is the plain policy gradient
    # one-token sequences at log-ratios around log(k/lam): the weight is largest at w = k/lam
    cfg = P.VESPOConfig(k_pos=2.0, lambda_pos=3.0)
    log_ratios = torch.tensor([[math.log(2.0 / 3.0) + d] for d in (-0.05, 0.0, 0.05)], dtype=torch.float64)
    _, swept = P.vespo_loss(log_ratios, torch.zeros(3, 1, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64),
                            torch.ones(3, 1), cfg)
    phi = swept["vespo_phi_mean"][:, 0]
    assert phi[1] > phi[0] and phi[1] > phi[2]
    assert phi[1].item() == pytest.approx((2.0 / 3.0) ** 2 * math.exp(3.0 * (1.0 - 2.0 / 3.0)), rel=1e-12)
