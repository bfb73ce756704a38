"""The audit's formula check: every built-in estimator and loss with a documented formula matches it
on the audit's random batch (with options that change the formula), and a wrong formula fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlite import hookimpl
from rlite.config import load_config
from rlite.plugin_manager import build_plugin_manager
from rlite.plugins import advantages as A
from rlite.tools.audit import FAIL, PASS, SKIP, check_formulas

ESTIMATORS = ["grpo", "{name: grpo, args: {singleton: raw, std_scope: batch}}", "{name: grpo, args: {norm_by_std: false}}",
              "dr_grpo", "{name: rloo, args: {singleton: raw}}", "opo", "gpg", "{name: gpg, args: {singleton: zero}}",
              "gdpo", "{name: gdpo, args: {whiten: false, singleton: raw}}", "remax"]
LOSSES = ["ppo_clip", "{name: ppo_clip, args: {dual_clip_c: 3.0, clip_high: 0.28, log_ratio_clamp: null}}", "gspo",
          "cispo", "{name: cispo, args: {mode: absolute}}", "sapo", "gmpo", "gpg", "reinforce_tis",
          "{name: reinforce_tis, args: {is_level: sequence, is_threshold: null}}",
          "{name: vespo, args: {k_pos: 1.0, lambda_pos: 0.5, k_neg: 0.5, lambda_neg: 4.0}}"]


def config(pm, advantage: str, loss: str):
    return load_config(None, ["model.path=m", "data.task=addition", f"algorithm.advantage={advantage}",
                              f"algorithm.policy_loss={loss}"], pm=pm)


@pytest.mark.parametrize("advantage, loss", list(zip(ESTIMATORS, LOSSES + LOSSES[:1])))
def test_builtins_match_their_documented_formulas(advantage, loss):
    pm = build_plugin_manager(autoload=False)
    checks = check_formulas(config(pm, advantage, loss), pm)
    assert [c.result for c in checks] == [PASS, PASS], checks


class Plugins:
    @hookimpl
    def register_advantage_estimators(self, register):
        def off_by_a_bit(batch, cfg):  # grpo scaled by 1.01: a drift no test of values would miss
            adv, ret = A.grpo_advantages(batch, cfg)
            return adv * 1.01, ret

        # claims grpo's formula: registers grpo's reference with it
        register("grpo_wrong", off_by_a_bit, A.GRPOConfig, reference=A.grpo_reference)
        register("custom", A.dr_grpo_advantages, A.DrGRPOConfig)
        register("custom_checked", A.dr_grpo_advantages, A.DrGRPOConfig, reference=A.dr_grpo_reference)


def test_a_wrong_formula_fails_and_an_unknown_one_is_not_claimed():
    pm = build_plugin_manager(autoload=False)
    pm.register(Plugins(), name="plugins")
    # a plugin that registered no reference: n/a, never a pass, and the row says so
    checks = check_formulas(config(pm, "custom", "ppo_clip"), pm)
    assert [c.result for c in checks] == [SKIP, PASS]
    assert "no reference registered by plugin 'plugins'" in checks[0].measured
    # a third-party estimator with a registered reference is checked by the same path as a built-in
    assert [c.result for c in check_formulas(config(pm, "custom_checked", "ppo_clip"), pm)] == [PASS, PASS]
    checks = check_formulas(config(pm, "grpo_wrong", "ppo_clip"), pm)
    assert checks[0].result == FAIL and torch.isfinite(torch.tensor(float(checks[0].measured.split("= ")[1].split()[0])))


def test_the_audit_keeps_no_table_of_formulas_by_name():
    """Every built-in formula row comes from the reference registered with the plugin: the audit's source
    names no estimator or loss."""
    import inspect

    import rlite.tools.audit

    source = inspect.getsource(rlite.tools.audit)
    pm = build_plugin_manager(autoload=False)
    for kind in ("advantage_estimator", "policy_loss"):
        for name, entry in pm.registry(kind).entries.items():
            assert entry.metadata.get("reference") is not None, f"{kind} {name} registers no reference"
            assert f'"{name}"' not in source, f"rlite/audit.py names {kind} {name!r}"


RETURN_ESTIMATORS = ["reinforce_pp", "{name: reinforce_pp, args: {gamma: 0.9, whiten: false}}", "reinforce_pp_baseline",
                     "{name: reinforce_pp_baseline, args: {singleton: raw, gamma: 0.8}}", "gae",
                     "{name: gae, args: {gamma: 0.9, lam: 0.95}}", "{name: gae, args: {gamma: 0.95, lam: 0.7, whiten: false}}",
                     "remax"]


def return_config(pm, advantage: str):
    critic = ["algorithm.critic.enabled=true"] if "gae" in advantage else []
    return config(pm, advantage, "ppo_clip") if not critic else load_config(
        None, ["model.path=m", "data.task=addition", f"algorithm.advantage={advantage}", *critic], pm=pm)


@pytest.mark.parametrize("advantage", RETURN_ESTIMATORS)
def test_return_based_estimators_match_their_loop_formulas(advantage):
    pm = build_plugin_manager(autoload=False)
    checks = check_formulas(return_config(pm, advantage), pm)
    assert checks[0].result == PASS and "advantages and returns" in checks[0].measured, checks


def test_every_builtin_estimator_and_loss_has_a_formula_row():
    pm = build_plugin_manager(autoload=False)
    for advantage in pm.registry("advantage_estimator").entries:
        assert check_formulas(return_config(pm, advantage), pm)[0].result == PASS, advantage
    for loss in pm.registry("policy_loss").entries:
        assert check_formulas(config(pm, "grpo", loss), pm)[1].result == PASS, loss


def swapped(pm, name: str, implementation):
    """The registry entry ``name`` with another implementation (same config class), restored on exit."""
    registry = pm.registry("advantage_estimator")
    original = registry.entries[name]
    registry.entries[name] = dataclasses.replace(original, implementation=implementation)
    return original


def drift_advantages(fn):
    return lambda batch, cfg: (lambda out: (out[0] * 1.01, out[1]))(fn(batch, cfg))


def drift_returns(fn):
    return lambda batch, cfg: (lambda out: (out[0], out[1] * 1.01))(fn(batch, cfg))


def gae_through_masked_tokens(batch, cfg):
    """GAE that does not skip tokens masked inside a response (slime's): wrong where tool spans are."""
    rewards = A.per_token_rewards(batch.scores, batch.response_mask, batch.token_rewards).to(batch.values.dtype)
    last = batch.response_mask.shape[1] - 1 - batch.response_mask.flip(-1).argmax(-1)
    span = (torch.arange(batch.response_mask.shape[1])[None, :] <= last[:, None]).double()
    advantages, returns = A.gae(rewards, batch.values * span, span, cfg.gamma, cfg.lam)
    advantages = advantages * batch.response_mask
    if cfg.whiten:
        advantages = A.masked_whiten(advantages, batch.response_mask)
    return advantages, returns * batch.response_mask


@pytest.mark.parametrize("name, make_wrong", [
    ("reinforce_pp", lambda: drift_advantages(A.reinforce_pp_advantages)),
    ("reinforce_pp_baseline", lambda: drift_advantages(A.reinforce_pp_baseline_advantages)),
    ("gae", lambda: drift_advantages(A.gae_advantages)),
    ("gae", lambda: drift_returns(A.gae_advantages)),
    ("reinforce_pp", lambda: drift_returns(A.reinforce_pp_advantages)),
    ("remax", lambda: drift_advantages(A.remax_advantages)),
    # with lam = 1 GAE telescopes to the return minus V_t and would not see the masked tokens
    ("{name: gae, args: {gamma: 0.9, lam: 0.95}}", lambda: gae_through_masked_tokens),
])
def test_a_wrong_return_based_estimator_fails(name, make_wrong):
    pm = build_plugin_manager(autoload=False)
    cfg = return_config(pm, name)
    name = cfg.algorithm.advantage.name
    registry = pm.registry("advantage_estimator")
    original = swapped(pm, name, make_wrong())
    try:
        checks = check_formulas(cfg, pm)
    finally:
        registry.entries[name] = original
    assert checks[0].result == FAIL, checks
    assert float(checks[0].measured.split("= ")[1].split()[0]) > 1e-4



def drifted_vespo(per_token_clamp: bool, length_mean: bool):
    """VESPO with one plausible drift: no +-20 clamp of each token before the sum, or GSPO's mean over the
    sequence instead of the sum."""
    import math

    def loss(logprobs, old_logprobs, advantages, response_mask, cfg):
        m = response_mask.double()
        x = logprobs.detach() - old_logprobs
        x = x.clamp(-20.0, 20.0) if per_token_clamp else x
        total = (x * m).sum(-1, keepdim=True) / (m.sum(-1, keepdim=True).clamp(min=1) if length_mean else 1.0)
        log_w = total.clamp(math.log(1e-8), 20.0)
        positive = advantages >= 0
        k = torch.where(positive, torch.full_like(log_w, cfg.k_pos), cfg.k_neg)
        lam = torch.where(positive, torch.full_like(log_w, cfg.lambda_pos), cfg.lambda_neg)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        return -phi * advantages * logprobs * m, {}

    return loss


@pytest.mark.parametrize("per_token_clamp, length_mean", [(False, False), (True, True)])
def test_a_drifted_vespo_fails(per_token_clamp, length_mean):
    """The audit's batch has a token at log-ratio 30 (TRL clamps it to 20 before the sum) and rows of
    several tokens (the sum is not the mean)."""
    pm = build_plugin_manager(autoload=False)
    registry = pm.registry("policy_loss")
    original = registry.entries["vespo"]
    registry.entries["vespo"] = dataclasses.replace(original, implementation=drifted_vespo(per_token_clamp, length_mean))
    try:
        checks = check_formulas(config(pm, "grpo", "vespo"), pm)
    finally:
        registry.entries["vespo"] = original
    assert checks[1].result == FAIL, checks
