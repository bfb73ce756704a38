"""Every algorithm recipe in configs/ runs end to end and its reward rises.

The recipes target the quickstart model and task; here they run on a tiny random model with a
reward it can learn in a few steps (the fraction of digit characters), keeping each recipe's
algorithm section exactly as shipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlite import hookimpl
from rlite.config import load_config
from rlite.plugin_manager import build_plugin_manager, set_plugin_manager
from rlite.run.loop import run_training
from rlite.testing import read_jsonl
from rlite.tokenizer import build_tiny_model_dir

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo", "remax", "opo", "gpg", "gdpo", "sapo",
           "gmpo", "reinforce_tis", "vespo"]

EXTRA = {"remax": ["training.lr=1e-2"]}
"""ReMax's advantage R - b is on the raw reward scale (no std division, and the greedy baseline is
close to the samples' rewards), so at the common learning rate it moves too little in 14 steps."""


class DigitsReward:
    @hookimpl
    def register_reward_functions(self, register):
        register("digits_fraction", lambda completion, sample, cfg: sum(c.isdigit() for c in completion) / max(len(completion), 1))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_and_reward_rises(tmp_path, model_dir, recipe):
    pm = build_plugin_manager(autoload=False)
    pm.register(DigitsReward(), name="digits-reward")
    set_plugin_manager(pm)
    try:
        cfg = load_config(
            CONFIGS / f"{recipe}.yaml",
            [
                f"model.path={model_dir}", "rewards=[digits_fraction]", "data.num_train=64", "data.num_eval=8",
                "training.steps=14", "training.lr=3e-3", "training.warmup_steps=0", "training.eval_every=0",
                "rollout.prompts_per_step=4", "rollout.samples_per_prompt=8", "rollout.temperature=1.0",
                f"logging.run_dir={tmp_path / 'run'}", "logging.progress_bar=false", "logging.plot=false",
                "logging.loggers=[jsonl]", "checkpoint.every=0", "checkpoint.save_final=false",
                "checkpoint.export_hf=false", "checkpoint.resume=never", *EXTRA.get(recipe, []),
            ],
            pm=pm,
        )
        run_training(cfg)
    finally:
        set_plugin_manager(None)
    rewards = [r["reward/mean"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rewards) == 14
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.05, rewards


def test_quickstart_config_runs_as_shipped(tmp_path):
    """The README's quickstart (shipped warm-start model, real config) for two steps."""
    import os

    cwd = os.getcwd()
    os.chdir(CONFIGS.parent)  # model.path in the config is relative to the repository root
    try:
        cfg = load_config(CONFIGS / "quickstart.yaml", [
            "training.steps=2", "training.eval_every=0", f"logging.run_dir={tmp_path / 'run'}",
            "logging.progress_bar=false", "logging.plot=false", "checkpoint.every=0", "checkpoint.resume=never",
        ], pm=build_plugin_manager(autoload=False))
        summary = run_training(cfg)
    finally:
        os.chdir(cwd)
    assert summary["eval_greedy_accuracy_first (step 0)"] > 0.1  # the warm start is partly competent
    assert (tmp_path / "run" / "hf_model" / "model.safetensors").is_file()
