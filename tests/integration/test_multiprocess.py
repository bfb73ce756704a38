"""The real command at world size 2: `torchrun --nproc_per_node 2 -m rlite train ...` on CPU (gloo)."""

from __future__ import annotations

import subprocess
import sys

from rlite.run.checkpoint import list_checkpoints
from rlite.testing import read_jsonl, run_in_subprocess_env
from rlite.tokenizer import build_tiny_model_dir


def test_torchrun_two_ranks_trains_checkpoints_resumes_and_exports(tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "tiny")
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {{path: {model_dir}}}\n"
        "data: {task: addition, num_train: 64, num_eval: 8}\n"
        "rollout: {prompts_per_step: 4, samples_per_prompt: 2, max_new_tokens: 4}\n"
        "training: {steps: 2, eval_every: 2, micro_batch_size: 2}\n"
        f"logging: {{run_dir: {run_dir}, progress_bar: false, plot: false, loggers: [jsonl]}}\n"
        "checkpoint: {every: 1, keep_last: 5}\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "rlite", "train", str(config)]
    done = subprocess.run(cmd, env=run_in_subprocess_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # rank 0 logs once per step
    assert rows[1]["response/length"] > 0
    ckpts = list_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000001", "step_00000002"]
    assert sorted(f.name for f in ckpts[-1].glob("trainer_state_rank*.pt")) == [
        "trainer_state_rank0.pt", "trainer_state_rank1.pt"
    ]
    assert (run_dir / "hf_model" / "model.safetensors").is_file()

    # one more step, resumed by both ranks from the step-2 checkpoint
    more = subprocess.run([*cmd, "training.steps=3"], env=run_in_subprocess_env(), capture_output=True,
                          text=True, timeout=240)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed from" in more.stderr
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
