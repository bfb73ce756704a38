"""The real command with tensor parallelism 2: `torchrun --nproc_per_node 2 -m rlite train ...
parallelism.backend={name: megatron, args: {tensor_parallel: 2}}` (CPU, gloo). Both ranks train on one
data shard: rank 0 generates and broadcasts, rank 1 only drains weight syncs. Its first step sees the
same samples as a 1-rank megatron run (same shard, same seeds, same weights) and gets the same loss."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")

from rlite.run.checkpoint import list_checkpoints  # noqa: E402
from rlite.testing import read_jsonl, run_in_subprocess_env  # noqa: E402
from rlite.tokenizer import build_tiny_model_dir  # noqa: E402


def test_two_rank_tensor_parallel_run_matches_one_rank_and_resumes(tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2)
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {{path: {model_dir}}}\n"
        "data: {task: addition, num_train: 64, num_eval: 8}\n"
        "rollout: {prompts_per_step: 4, samples_per_prompt: 4, max_new_tokens: 4}\n"
        "training: {steps: 2, eval_every: 2, micro_batch_size: 4}\n"
        "logging: {progress_bar: false, plot: false, loggers: [jsonl]}\n"
        "checkpoint: {every: 1, keep_last: 5}\n"
    )
    env = run_in_subprocess_env(RLITE_DISABLE_PLUGIN_AUTOLOAD="")  # megatron comes from its entry point
    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    train = ["-m", "rlite", "train", str(config)]
    cmd = [*torchrun, *train, f"logging.run_dir={tp2}", "parallelism.backend={name: megatron, args: {tensor_parallel: 2}}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    single = subprocess.run([sys.executable, *train, f"logging.run_dir={tp1}", "parallelism.backend=megatron"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    two, one = read_jsonl(tp2 / "metrics.jsonl"), read_jsonl(tp1 / "metrics.jsonl")
    assert [r["step"] for r in two] == [0, 1, 2]  # rank 0 logs once per step
    assert two[0]["eval/greedy_accuracy"] == one[0]["eval/greedy_accuracy"]
    for key in ("reward/mean", "response/length"):  # the same samples
        assert two[1][key] == one[1][key], key
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert two[1][key] == pytest.approx(one[1][key], rel=1e-5, abs=1e-7), key
    ckpts = list_checkpoints(tp2 / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000001", "step_00000002"]
    assert (tp2 / "hf_model" / "model.safetensors").is_file()
    more = subprocess.run([*cmd, "training.steps=3"], env=env, capture_output=True, text=True, timeout=300)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed from" in more.stderr
    assert [r["step"] for r in read_jsonl(tp2 / "metrics.jsonl")] == [0, 1, 2, 3]
