"""True on-policy mode on CUDA: the transformers engine's fixed-shape sampler and the trainer's exact
layout give bitwise equal log-probs on the GPU, in fp32 and in bf16, and in the real loop every
mismatch metric reads exactly 0. Skipped without CUDA.

The loop test runs the built-in ``transformers`` engine as configured by default: on the trainer's GPU,
sharing the trainer's weight storage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WARMSTART = str(Path(__file__).resolve().parents[2] / "examples" / "warmstart" / "addition-qwen2-1m")
MAX_NEW_TOKENS = 8
TEMPERATURE = 0.7


def _addition_prompts(tokenizer, count: int) -> list[list[int]]:
    from rlite.config import DataConfig
    from rlite.data import load_prompt_splits

    train, _ = load_prompt_splits(DataConfig(task="addition", task_args={"digits": 2}, num_train=count, num_eval=8),
                                  tokenizer)
    return [item.prompt_ids for item in train.items[:count]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_and_trainer_logprobs_are_bitwise_equal_on_cuda(dtype, measure):
    from transformers import AutoTokenizer

    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.distributed import init_distributed, shutdown_distributed
    from rlite.engines.base import SamplingParams
    from rlite.hf_models import load_causal_lm
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.plugins.transformers.engine import TransformersEngine
    from rlite.rollout import build_rollout_batch
    from rlite.training.backend import ForwardSpec

    ctx = init_distributed()
    try:
        tokenizer = AutoTokenizer.from_pretrained(WARMSTART)
        backend = FSDP2Backend.build(ModelConfig(path=WARMSTART), ParallelismConfig(param_dtype=dtype),
                                     TrainingConfig(), ctx.device, 1)
        # the engine computes in the trainer's compute dtype; fp32 binds the trainer's own storage. (Loaded
        # in that dtype, not cast: ``.to(bfloat16)`` would also round the rotary ``inv_freq`` buffer, which
        # FSDP2's mixed precision leaves in fp32.)
        model = load_causal_lm(ModelConfig(path=WARMSTART, dtype=dtype)).to(ctx.device)
        engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id],
                                    true_on_policy=True, share_weights=True)
        engine.update_weights(backend.full_weights(views=True), version=1)
        prompts = _addition_prompts(tokenizer, 8)
        completions = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=MAX_NEW_TOKENS,
                                                              temperature=TEMPERATURE, seed=0))
        batch = build_rollout_batch(prompts, completions, [{}] * len(prompts), 0, pad_token_id=tokenizer.pad_token_id,
                                    fixed_width=MAX_NEW_TOKENS)
        mask = batch.response_mask.bool()
        assert {c.finish_reason for c in completions} >= {"stop"}, "some completions end early (padding after a stop)"

        def score(micro_batch_size: int) -> torch.Tensor:
            spec = ForwardSpec(micro_batch_size=micro_batch_size, temperature=TEMPERATURE, chunk_size=1024,
                               exact_layout=True)
            with torch.no_grad():
                return torch.cat([backend.logprobs(batch.select(slice(i, i + micro_batch_size)), spec)[0].cpu()
                                  for i in range(0, len(batch), micro_batch_size)])

        same_batch = score(len(batch))  # the trainer scores the engine's batch in one forward, as it sampled
        assert torch.equal(same_batch[mask], batch.rollout_logprobs[mask]), (
            f"{dtype}: max |diff| {(same_batch - batch.rollout_logprobs)[mask].abs().max():.3e}"
        )
        # a smaller micro-batch changes the matrix shapes; measured, not asserted
        halves = score(len(batch) // 2)
        equal = (halves[mask] == batch.rollout_logprobs[mask]).float().mean().item()
        worst = (halves - batch.rollout_logprobs)[mask].abs().max().item()
        measure(f"true on-policy {dtype}: micro-batch = engine batch", "bitwise equal",
                note=f"{int(mask.sum())} tokens")
        measure(f"true on-policy {dtype}: micro-batch = half the engine batch",
                f"{equal:.3f} of tokens bitwise equal, max |diff| {worst:.2e}")
        backend.close()
    finally:
        shutdown_distributed(ctx)


def test_true_on_policy_run_on_cuda_reports_zero_mismatch(tmp_path):
    from rlite.plugin_manager import build_plugin_manager, set_plugin_manager
    from rlite.run.loop import run_training
    from rlite.testing import read_jsonl, tiny_config
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = build_tiny_model_dir(tmp_path / "tiny")
    pm = build_plugin_manager(autoload=False)
    set_plugin_manager(pm)
    try:
        # the trainer's micro-batch is the engine's batch (2 prompts x 4 samples): the same shapes
        # the default engine: on the trainer's GPU, sharing its storage (rollout.engine.args device/share_weights)
        cfg = tiny_config(model_dir, tmp_path / "run", "rollout.true_on_policy=true",
                          f"rollout.temperature={TEMPERATURE}", "training.steps=3", "rollout.samples_per_prompt=4",
                          "rollout.max_new_tokens=6", "training.micro_batch_size=8", pm=pm)
        run_training(cfg, pm)
    finally:
        set_plugin_manager(None)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 3
    for row in rows:
        assert row["mismatch/bitwise_equal_fraction"] == 1.0, row["mismatch/max_abs_diff"]
        assert row["mismatch/max_abs_diff"] == 0.0
        assert row["mismatch/kl"] == 0.0
