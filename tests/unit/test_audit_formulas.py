"""The audit's formula check: every built-in estimator and loss with a documented formula matches it
on the audit's random batch (with options that change the formula), and a wrong formula fails."""

from __future__ import annotations

import pytest
import torch

from rlite import hookimpl
from rlite.audit import FAIL, PASS, SKIP, check_formulas
from rlite.config import load_config
from rlite.plugin_manager import build_plugin_manager
from rlite.plugins import advantages as A

ESTIMATORS = ["grpo", "{name: grpo, args: {singleton: raw, std_scope: batch}}", "{name: grpo, args: {norm_by_std: false}}",
              "dr_grpo", "{name: rloo, args: {singleton: raw}}", "opo", "gpg", "{name: gpg, args: {singleton: zero}}",
              "gdpo", "{name: gdpo, args: {whiten: false, singleton: raw}}", "remax"]
LOSSES = ["ppo_clip", "{name: ppo_clip, args: {dual_clip_c: 3.0, clip_high: 0.28, log_ratio_clamp: null}}", "gspo",
          "cispo", "{name: cispo, args: {mode: absolute}}", "sapo", "gmpo", "gpg", "reinforce_tis",
          "{name: reinforce_tis, args: {is_level: sequence, is_threshold: null}}"]


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

        register("grpo_wrong", off_by_a_bit, A.GRPOConfig)
        register("custom", A.dr_grpo_advantages, A.DrGRPOConfig)


def test_a_wrong_formula_fails_and_an_unknown_one_is_not_claimed():
    pm = build_plugin_manager(autoload=False)
    pm.register(Plugins(), name="plugins")
    # a plugin registered under another name has no documented formula: n/a, never a pass
    assert [c.result for c in check_formulas(config(pm, "custom", "ppo_clip"), pm)] == [SKIP, PASS]
    wrong = config(pm, "grpo_wrong", "ppo_clip")
    wrong.algorithm.advantage.name = "grpo"  # pretend it claims grpo's formula
    registry = pm.registry("advantage_estimator")
    original = registry.entries["grpo"]
    registry.entries["grpo"] = registry.entries["grpo_wrong"]
    try:
        checks = check_formulas(wrong, pm)
    finally:
        registry.entries["grpo"] = original
    assert checks[0].result == FAIL and torch.isfinite(torch.tensor(float(checks[0].measured.split("= ")[1].split()[0])))
