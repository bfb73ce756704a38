"""Rollout routing replay in the real loop: a tiny MoE whose experts dominate its residual stream,
rollouts in FP8 (the engine's routers then see other hidden states), the transformers engine
recording routing and the trainer replaying it. Without replay a measurable fraction of tokens routes
differently and the mismatch KL is higher than with replay; with replay the trainer's routing is the
engine's exactly. The megatron twin is tests/megatron/test_routing_replay_megatron.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlite.config import ConfigError, load_config
from rlite.plugin_manager import build_plugin_manager
from rlite.run.loop import run_training
from rlite.testing import read_jsonl
from rlite.tokenizer import build_tiny_model_dir

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def strong_experts_moe(path: Path) -> Path:
    """A tiny Qwen3-MoE (8 experts, top-2) with its experts scaled up, as in a trained MoE whose
    experts carry the signal: a token routed elsewhere then changes the output measurably."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model_dir(path, hidden=64, layers=2, num_experts=8, experts_per_token=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(4.0)
    model.save_pretrained(model_dir)
    return model_dir


def run(tmp_path: Path, model_dir: Path, name: str, *overrides: str, pm=None) -> list[dict]:
    pm = pm or build_plugin_manager(autoload=False)
    cfg = load_config(QUICKSTART, [
        f"model.path={model_dir}", "data.num_train=64", "data.num_eval=8",
        "training.steps=2", "training.eval_every=0",
        "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=12",
        "rollout.quantization=fp8_blockwise",
        f"logging.run_dir={tmp_path / name}", "logging.progress_bar=false", "logging.plot=false",
        "logging.loggers=[jsonl]", "checkpoint.every=0", "checkpoint.save_final=false",
        "checkpoint.export_hf=false", "checkpoint.resume=never", *overrides,
    ], pm)
    run_training(cfg, pm)
    return [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "reward/mean" in r]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return strong_experts_moe(tmp_path_factory.mktemp("moe") / "strong")


def check_replay_metrics(rows: list[dict]) -> None:
    for row in rows:
        assert row["routing/agreement_with_replay"] == 1.0  # the engine's experts, every token, every layer
        assert row["routing/agreement_with_replay_min_layer"] == 1.0
        assert row["routing/agreement_without_replay"] < 0.995  # FP8 rollouts route some tokens elsewhere
        assert row["routing/mismatch_k3_kl_without_replay"] > 1.3 * row["routing/mismatch_k3_kl_with_replay"]


def test_fp8_rollouts_route_differently_and_replay_lowers_the_mismatch(tmp_path, moe_dir):
    replayed = run(tmp_path, moe_dir, "replay", "algorithm.routing_replay=rollout")
    natural = run(tmp_path, moe_dir, "natural", "algorithm.routing_replay=none")
    check_replay_metrics(replayed)
    check_replay_metrics(natural)
    # the same rollout (step 1 samples before any update): the trained-on forward is the mode's
    for key in ("reward/mean", "routing/agreement_without_replay", "routing/mismatch_k3_kl_with_replay"):
        assert replayed[0][key] == natural[0][key], key
    assert replayed[0]["mismatch/k3_kl"] == pytest.approx(replayed[0]["routing/mismatch_k3_kl_with_replay"], rel=1e-6)
    assert natural[0]["mismatch/k3_kl"] == pytest.approx(natural[0]["routing/mismatch_k3_kl_without_replay"], rel=1e-6)


def test_routing_metrics_off_and_dense_models(tmp_path, moe_dir):
    rows = run(tmp_path, moe_dir, "quiet", "algorithm.routing_metrics=false", "rollout.quantization=none")
    assert not any(k.startswith("routing/") for k in rows[-1])
    dense = build_tiny_model_dir(tmp_path / "dense", hidden=32, layers=2)
    assert not any(k.startswith("routing/") for k in run(tmp_path, dense, "dense", "rollout.quantization=none")[-1])
    with pytest.raises(ConfigError, match="algorithm.routing_replay=rollout with the dense model model.path=.*no Mixture-of-Experts"):
        run(tmp_path, dense, "dense-replay", "algorithm.routing_replay=rollout")
    with pytest.raises(ConfigError, match="algorithm.routing_replay"):
        run(tmp_path, dense, "bad", "algorithm.routing_replay=always")
