"""DAPO pieces (dynamic sampling, truncation masking, overlong penalty) and the KL terms in real runs."""

from __future__ import annotations

import pytest

from rlite import hookimpl
from rlite.plugin_manager import build_plugin_manager, set_plugin_manager
from rlite.plugins.rewards import OverlongPenaltyConfig, overlong_penalty
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


class BatchProbe:
    """A digits reward plus a record of every training batch's loss mask."""

    def __init__(self):
        self.batches = []

    @hookimpl
    def register_reward_functions(self, register):
        register("digits_fraction", lambda c, s, cfg: sum(ch.isdigit() for ch in c) / max(len(c), 1))

    @hookimpl
    def after_optimizer_step(self, step, model):
        pass


@pytest.fixture
def probe():
    pm = build_plugin_manager(autoload=False)
    probe = BatchProbe()
    pm.register(probe, name="probe")
    set_plugin_manager(pm)
    yield pm
    set_plugin_manager(None)


def _rows(tmp_path):
    return [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]


def test_dynamic_sampling_keeps_only_groups_with_signal(tmp_path, model_dir, probe):
    cfg = tiny_config(model_dir, tmp_path / "run", "rewards=[digits_fraction]", "training.steps=3",
                      "rollout.samples_per_prompt=2", "rollout.prompts_per_step=4", "rollout.max_new_tokens=3",
                      "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_rounds=6", pm=probe)
    run_training(cfg)
    rows = _rows(tmp_path)
    assert len(rows) == 3
    for row in rows:
        assert row["dynamic_sampling/rounds"] >= 1
        if row["dynamic_sampling/kept_fraction"] == 1.0:
            assert row["advantage/zero_variance_groups"] == 0.0
    # with pairs of 3-token samples many groups are flat, so extra rounds were needed at least once
    assert max(r["dynamic_sampling/rounds"] for r in rows) > 1
    assert sum(r["dynamic_sampling/dropped_groups"] for r in rows) > 0


def test_overlong_penalty_values():
    cfg = OverlongPenaltyConfig(max_length=10, buffer=4)
    values = [overlong_penalty("", {"response_length": n}, cfg) for n in (0, 6, 7, 8, 10, 11)]
    assert values == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_mask_truncated_removes_truncated_samples_from_the_loss(tmp_path, model_dir, probe):
    # a random tiny model almost never stops within 2 tokens: every sample is truncated, so nothing
    # is left to train on and the policy loss and gradient are exactly 0
    cfg = tiny_config(model_dir, tmp_path / "run", "rewards=[digits_fraction]", "training.steps=2",
                      "rollout.max_new_tokens=2", "algorithm.mask_truncated=true", pm=probe)
    run_training(cfg)
    rows = _rows(tmp_path)
    for row in rows:
        assert row["response/truncated"] == 1.0
        assert row["actor/grad_norm"] == 0.0
        assert row["actor/pg_loss"] == 0.0


def test_kl_loss_is_zero_at_the_reference_then_grows(tmp_path, model_dir, probe):
    cfg = tiny_config(model_dir, tmp_path / "run", "rewards=[digits_fraction]", "training.steps=4",
                      "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6", "training.lr=1e-2",
                      "algorithm.kl.coef=0.1", "algorithm.kl.estimator=k3", pm=probe)
    run_training(cfg)
    kl = [r["actor/kl_loss"] for r in _rows(tmp_path)]
    assert kl[0] == 0.0  # the first forward of step 1 uses exactly the reference weights
    assert kl[-1] > 0.0


def test_adaptive_kl_in_reward_moves_the_coefficient(tmp_path, model_dir, probe):
    cfg = tiny_config(model_dir, tmp_path / "run", "rewards=[digits_fraction]", "training.steps=4",
                      "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6", "training.lr=1e-2",
                      "algorithm.kl.coef=0.1", "algorithm.kl.in_reward=true", "algorithm.kl.estimator=k1",
                      "algorithm.kl.adaptive_target=1.0", "algorithm.kl.adaptive_horizon=100", pm=probe)
    run_training(cfg)
    rows = _rows(tmp_path)
    coefs = [r["actor/reward_kl_penalty_coeff"] for r in rows]
    penalties = [r["actor/reward_kl"] for r in rows]
    assert penalties[0] == 0.0 and coefs[0] == pytest.approx(0.1)
    # KL far below the target: the controller lowers beta by 20% x n/horizon per step
    n = 2 * 8
    assert coefs[1] == pytest.approx(0.1 * (1 - 0.2 * n / 100))
    assert coefs[-1] < coefs[0]
    assert "actor/kl_loss" not in rows[0]  # KL went into the reward, not the loss
