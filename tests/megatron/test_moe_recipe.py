"""configs/moe_megatron_cpu.yaml runs as shipped (its algorithm and backend sections) on a tiny
random Qwen3-MoE with a reward such a model learns in a few steps, and its reward rises."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")

import rlite.plugins.megatron as megatron_plugin  # noqa: E402
from rlite import hookimpl  # noqa: E402
from rlite.config import load_config  # noqa: E402
from rlite.plugin_manager import build_plugin_manager  # noqa: E402
from rlite.run.loop import run_training  # noqa: E402
from rlite.testing import read_jsonl  # noqa: E402
from rlite.tokenizer import build_tiny_model_dir  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "moe_megatron_cpu.yaml"


class DigitsReward:
    @hookimpl
    def register_reward_functions(self, register):
        register("digits_fraction", lambda completion, sample, cfg: sum(c.isdigit() for c in completion) / max(len(completion), 1))


def test_moe_recipe_reward_rises(tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "moe", hidden=64, layers=2, num_experts=4, experts_per_token=2)
    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")
    pm.register(DigitsReward(), name="digits-reward")
    cfg = load_config(RECIPE, [
        f"model.path={model_dir}", "rewards=[digits_fraction]", "data.num_train=64", "data.num_eval=8",
        "training.steps=24", "training.lr=3e-3", "training.warmup_steps=0", "training.eval_every=0",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=8", "rollout.temperature=1.0",
        f"logging.run_dir={tmp_path / 'run'}", "logging.progress_bar=false", "logging.plot=false",
        "logging.loggers=[jsonl]", "checkpoint.every=0", "checkpoint.save_final=false",
        "checkpoint.export_hf=false", "checkpoint.resume=never",
    ], pm)
    assert cfg.parallelism.backend.name == "megatron"
    run_training(cfg, pm)
    rewards = [r["reward/mean"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rewards) == 24
    assert sum(rewards[-6:]) / 6 > sum(rewards[:6]) / 6 + 0.05, rewards
