"""Multi-turn recipes run end to end through ``rlite train``'s path, the environment's reward rises, and
the loss mask the trainer uses excludes every observation token.

As in test_recipes.py, a tiny random model learns a reward it can learn in a few steps: here an
environment that rewards the fraction of digits in each of three turns and answers every turn with a
short message, so that every trajectory has observation spans inside its response."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlite import hookimpl
from rlite.config import load_config
from rlite.plugin_manager import build_plugin_manager, set_plugin_manager
from rlite.run.loop import run_training
from rlite.testing import read_jsonl
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUIET = [
    "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]", "checkpoint.every=0",
    "checkpoint.save_final=false", "checkpoint.export_hf=false", "checkpoint.resume=never",
]


class DigitTurns:
    def reset(self, sample):
        self.digit_turns = 0
        return None

    def step(self, action):
        text = action.text
        reward = sum(c.isdigit() for c in text) / max(len(text), 1) / 3
        self.digit_turns += any(c.isdigit() for c in text)
        return "ok?", reward, action.turn == 2

    def metrics(self):
        return {"digit_turns": self.digit_turns, "correct": float(self.digit_turns >= 2)}


class Plugin:
    @hookimpl
    def register_rollout_workflows(self, register):
        register("digit_turns", lambda cfg, tokenizer: DigitTurns())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def test_multiturn_reward_rises_and_observations_stay_out_of_the_loss(tmp_path, model_dir, monkeypatch):
    from rlite.stages.targets import Targets

    prepared = []  # each step's batch and the targets the update trains with (stage 3's product)
    prepare = Targets.prepare
    monkeypatch.setattr(Targets, "prepare", lambda self, batch: prepared.append((batch, prepare(self, batch))) or
                        prepared[-1][1])
    pm = build_plugin_manager(autoload=False)
    pm.register(Plugin(), name="digit-turns")
    set_plugin_manager(pm)
    try:
        cfg = load_config(CONFIGS / "multiturn_arithmetic.yaml", [
            f"model.path={model_dir}", "rollout.workflow=digit_turns", "data.num_train=64", "data.num_eval=8",
            "training.steps=12", "training.lr=3e-3", "training.warmup_steps=0", "training.eval_every=0",
            "rollout.prompts_per_step=4", "rollout.samples_per_prompt=8", "rollout.temperature=1.0",
            "rollout.max_new_tokens=4", f"logging.run_dir={tmp_path / 'run'}", *QUIET,
        ], pm=pm)  # fmt: skip
        run_training(cfg)
    finally:
        set_plugin_manager(None)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) == 12
    assert all(r["rollout/turns"] == 3.0 and r["rollout/observation_tokens"] > 0 for r in rows)
    # the environment's metrics() are averaged, and its "correct" is what accuracy counts (the task's
    # answer check would read the whole transcript, every turn and observation, against the first answer)
    assert all(0 <= r["rollout/env/digit_turns"] <= 3 for r in rows)
    assert all(r["reward/accuracy"] == r["rollout/env/correct"] for r in rows)
    assert max(r["reward/accuracy"] for r in rows) > 0
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.05, rewards
    assert len(prepared) == 12
    for batch, targets in ((batch, result.targets) for batch, result in prepared):
        observed = batch.response_present - batch.response_mask
        assert observed.sum() > 0
        assert (targets.loss_mask * observed).sum() == 0  # no observation token in the loss
        assert (targets.advantages * observed).abs().sum() == 0
        assert ((targets.loss_mask > 0) <= (batch.response_mask > 0)).all()


@pytest.mark.parametrize("recipe", ["multiturn_arithmetic", "multiturn_calculator"])
def test_multiturn_recipe_runs_as_shipped(tmp_path, recipe):
    """The shipped recipe (the quickstart model and a built-in environment) for one step."""
    cwd = os.getcwd()
    os.chdir(CONFIGS.parent)  # model.path in the config is relative to the repository root
    try:
        cfg = load_config(CONFIGS / f"{recipe}.yaml", [
            "training.steps=1", "training.eval_every=1", "training.eval_max_prompts=8", "rollout.prompts_per_step=2",
            f"logging.run_dir={tmp_path}", *QUIET,
        ], pm=build_plugin_manager(autoload=False))  # fmt: skip
        run_training(cfg)
    finally:
        os.chdir(cwd)
    (row,) = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    assert 1.0 <= row["rollout/turns"] <= 3.0
    assert row["reward/mean"] == pytest.approx(row["rollout/env_reward"])
    # held-out prompts are played through the environment: its metrics, and accuracy is its "correct"
    for mode in ("greedy", "sampled"):
        assert row[f"eval/{mode}_accuracy"] == pytest.approx(row[f"eval/{mode}_env/correct"])
        assert {"multiturn_arithmetic": "turn_2_correct", "multiturn_calculator": "used_tool"}[recipe] in {
            k.split("/")[-1] for k in row if k.startswith(f"eval/{mode}_env/")}


def test_arithmetic_chain_reward_rises_through_its_recipe(tmp_path, monkeypatch):
    """``rlite train configs/multiturn_arithmetic.yaml`` (the shipped multi-turn warm start and the
    built-in three-problem game) on 8 fixed games: the environment's reward rises in 10 steps. Measured
    with seeds 0-2: the first three steps' mean 0.61-0.64, the last three's 0.75-0.82 (docs/multiturn.md)."""
    monkeypatch.chdir(CONFIGS.parent)  # model.path in the config is relative to the repository root
    code = main(["train", str(CONFIGS / "multiturn_arithmetic.yaml"), "training.steps=10", "training.warmup_steps=0",
                 "data.num_train=8", "rollout.prompts_per_step=8", "training.eval_every=0",
                 f"logging.run_dir={tmp_path}", *QUIET])  # fmt: skip
    assert code == 0
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) == 10 and all(r["rollout/turns"] == 3.0 for r in rows)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards
    for r in rows:  # the reward is the three problems' 1/3 each, and accuracy counts the games won
        assert r["reward/mean"] == pytest.approx(sum(r[f"rollout/env/turn_{i}_correct"] for i in range(3)) / 3)
        assert r["reward/accuracy"] == pytest.approx(r["rollout/env/correct"])
