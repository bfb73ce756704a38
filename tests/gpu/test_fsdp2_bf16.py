"""FSDP2 on CUDA in bf16 mixed precision: a short GRPO run learns, and the bf16 forward's log-probs
stay within a stated tolerance of the fp32 forward's. Skipped without CUDA.

The rollouts come from the built-in transformers engine exactly as ``rlite train`` builds it on a
GPU machine; only the trainer (FSDP2, ``parallelism.param_dtype=bfloat16``) is under test here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rlite import hookimpl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WARMSTART = str(Path(__file__).resolve().parents[2] / "examples" / "warmstart" / "addition-qwen2-1m")

# bf16 against fp32 log-probs of the same sampled tokens, on the warm-started quickstart model:
# bf16 keeps 8 bits of mantissa, so logits of size ~10 carry errors of a few hundredths
BF16_MEAN_ABS_TOL = 0.05
"""Mean |log p_bf16 - log p_fp32| over the response tokens, in nats."""
BF16_MAX_ABS_TOL = 0.5
"""Largest |log p_bf16 - log p_fp32| of any response token, in nats."""


@dataclass
class DigitRewardConfig:
    digit: str = "1"
    """The digit the reward counts."""


class DigitReward:
    """Reward = fraction of completion characters equal to one digit: a random tiny model learns it
    in a few steps (the same test plugin as tests/integration/test_train_loop.py)."""

    @hookimpl
    def register_reward_functions(self, register):
        def fraction_of_digit(completion, sample, cfg):
            return sum(ch == cfg.digit for ch in completion) / max(len(completion), 1)

        register("digit_fraction", fraction_of_digit, DigitRewardConfig)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def pm_with_digit_reward():
    from rlite.plugin_manager import build_plugin_manager, set_plugin_manager

    pm = build_plugin_manager(autoload=False)
    pm.register(DigitReward(), name="digit-reward")
    set_plugin_manager(pm)
    yield pm
    set_plugin_manager(None)


def test_bf16_grpo_run_learns_on_held_out_prompts(tmp_path, model_dir, pm_with_digit_reward, measure):
    from rlite.distributed import shutdown_distributed
    from rlite.run.build import build_run
    from rlite.run.loop import train
    from rlite.testing import read_jsonl, tiny_config

    cfg = tiny_config(
        model_dir,
        tmp_path / "run",
        "parallelism.param_dtype=bfloat16",
        "rewards=[digit_fraction]",
        "training.steps=12",
        "training.lr=3e-3",
        "training.eval_every=12",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=8",
        "rollout.max_new_tokens=6",
        "training.micro_batch_size=32",
        "data.num_eval=32",
        pm=pm_with_digit_reward,
    )
    run = build_run(cfg, pm_with_digit_reward)
    compute_dtypes = set()

    def record_input_dtype(module, args, kwargs):
        compute_dtypes.add((args[0] if args else kwargs["hidden_states"]).dtype)

    first_block = run.policy.backend.model.causal_lm.get_decoder().layers[0]
    hook = first_block.register_forward_pre_hook(record_input_dtype, with_kwargs=True)
    before = {n: p.detach().full_tensor().clone() for n, p in run.policy.backend.model.named_parameters()}
    try:
        train(run)
    finally:
        hook.remove()
        run.engine.shutdown()
        shutdown_distributed(run.ctx)
    after = {n: p.detach().full_tensor() for n, p in run.policy.backend.model.named_parameters()}
    assert all(t.device.type == "cuda" and t.dtype == torch.float32 for t in after.values()), "fp32 master weights on the GPU"
    assert compute_dtypes == {torch.bfloat16}, f"the decoder must compute in bf16, saw {compute_dtypes}"
    assert all(not torch.equal(before[n], after[n]) for n in before), "every parameter should move"
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in rows if "eval/sampled_reward" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 12
    first, last = evals[0], evals[-1]
    measure("bf16 GRPO: held-out greedy reward", f"{first['eval/greedy_reward']:.3f} -> {last['eval/greedy_reward']:.3f}",
            note="step 0 -> 12")
    measure("bf16 GRPO: held-out sampled reward", f"{first['eval/sampled_reward']:.3f} -> {last['eval/sampled_reward']:.3f}",
            note="step 0 -> 12")
    assert last["eval/greedy_reward"] >= first["eval/greedy_reward"] + 0.5
    assert last["eval/sampled_reward"] > first["eval/sampled_reward"]
    train_rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(train_rewards[-3:]) > sum(train_rewards[:3])
    assert all(math.isfinite(r["actor/grad_norm"]) for r in rows if "actor/grad_norm" in r)


def _sampled_batch(tokenizer, engine, n_prompts: int, samples: int, max_new_tokens: int):
    """Addition prompts with completions the model itself sampled (likely tokens, as in training)."""
    from rlite.config import DataConfig
    from rlite.data import load_prompt_splits
    from rlite.engines.base import SamplingParams
    from rlite.rollout import build_rollout_batch

    train_prompts, _ = load_prompt_splits(DataConfig(task="addition", task_args={"digits": 2}, num_train=n_prompts,
                                                     num_eval=8), tokenizer)
    prompts = [item.prompt_ids for item in train_prompts.items[:n_prompts]]
    completions = engine.generate(prompts, SamplingParams(n=samples, max_new_tokens=max_new_tokens, temperature=1.0,
                                                          seed=0))
    return build_rollout_batch(prompts, completions, [{}] * len(prompts), 0, pad_token_id=tokenizer.pad_token_id)


def test_bf16_logprobs_match_fp32_within_tolerance(measure):
    from transformers import AutoTokenizer

    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.distributed import init_distributed, shutdown_distributed
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.plugins.transformers.engine import TransformersEngine
    from rlite.training.backend import ForwardSpec

    ctx = init_distributed()
    try:
        assert ctx.device.type == "cuda"
        tokenizer = AutoTokenizer.from_pretrained(WARMSTART)
        engine = TransformersEngine.from_pretrained(WARMSTART, pad_token_id=tokenizer.pad_token_id,
                                                    eos_token_ids=[tokenizer.eos_token_id])
        batch = _sampled_batch(tokenizer, engine, n_prompts=32, samples=8, max_new_tokens=8)
        spec = ForwardSpec(micro_batch_size=64, temperature=1.0, chunk_size=1024, exact_layout=False, share_prompts=True)
        scores = {}
        for dtype in ("float32", "bfloat16"):
            backend = FSDP2Backend.build(ModelConfig(path=WARMSTART), ParallelismConfig(param_dtype=dtype),
                                         TrainingConfig(), ctx.device, total_optimizer_steps=1)
            with torch.no_grad():
                scores[dtype] = torch.cat([backend.logprobs(batch.select(slice(i, i + spec.micro_batch_size)), spec)[0].cpu()
                                           for i in range(0, len(batch), spec.micro_batch_size)])
            backend.close()
        mask = batch.response_mask.bool()
        diff = (scores["bfloat16"] - scores["float32"]).abs()[mask]
        fp32_vs_engine = (scores["float32"] - batch.rollout_logprobs).abs()[mask]
        measure("bf16 vs fp32 log-probs: max abs error", f"{diff.max().item():.4f}", "nats",
                f"{int(mask.sum())} sampled tokens, warm-started 1M quickstart model")
        measure("bf16 vs fp32 log-probs: mean abs error", f"{diff.mean().item():.5f}", "nats")
        measure("fp32 CUDA trainer vs fp32 CPU engine log-probs: max abs diff", f"{fp32_vs_engine.max().item():.2e}", "nats")
        assert diff.max() > 0, "the bf16 forward must differ from the fp32 one (else bf16 was not applied)"
        assert diff.mean() <= BF16_MEAN_ABS_TOL, diff.mean()
        assert diff.max() <= BF16_MAX_ABS_TOL, diff.max()
        assert fp32_vs_engine.max() < 1e-3, "the fp32 trainer on the GPU scores what the CPU engine sampled"
    finally:
        shutdown_distributed(ctx)


def test_ppo_with_critic_runs_on_cuda_in_bf16(tmp_path, model_dir):
    """GAE's critic goes through the same device hand-over as the policy (values back to the batch)."""
    from rlite.run.loop import run_training
    from rlite.testing import read_jsonl, tiny_config

    cfg = tiny_config(
        model_dir, tmp_path / "ppo", "parallelism.param_dtype=bfloat16", "training.steps=3",
        "algorithm.advantage=gae", "algorithm.critic.enabled=true", "algorithm.minibatches_per_step=2",
        "algorithm.kl.coef=0.05", "algorithm.kl.in_reward=true", "algorithm.kl.estimator=k1",
    )
    run_training(cfg)
    rows = [r for r in read_jsonl(tmp_path / "ppo" / "metrics.jsonl") if "critic/vf_loss" in r]
    assert len(rows) == 3
    for row in rows:
        for key in ("critic/vf_loss", "critic/values_mean", "critic/grad_norm", "actor/pg_loss", "actor/reward_kl"):
            assert math.isfinite(row[key]), (key, row[key])
