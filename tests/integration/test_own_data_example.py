"""examples/own_data as a user runs it: ``rlite train examples/own_data/config.yaml`` from the repository
root, for three steps, reads its jsonl rows through the nested answer key and scores them with the
reward function named by file path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from rlite.testing import read_jsonl, run_in_subprocess_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "own_data"


def file_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / name).read_text().splitlines()]


def test_shipped_data_is_what_make_data_writes_and_eval_is_held_out(tmp_path):
    script = tmp_path / "make_data.py"
    script.write_text((EXAMPLE / "make_data.py").read_text())
    subprocess.run([sys.executable, str(script)], check=True, timeout=120)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_text() == (EXAMPLE / name).read_text(), name
    train, held_out = file_rows("train.jsonl"), file_rows("eval.jsonl")
    assert len(train) == 400 and len(held_out) == 100
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    for row in train + held_out:
        a, b = row["question"].removesuffix("=").split("+")
        assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))


def test_own_data_example_trains_through_the_cli(tmp_path):
    config = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    assert config["data"]["answer_key"] == "reward_model.ground_truth"  # the nested key this example shows
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlite", "train", "examples/own_data/config.yaml", "training.steps=3",
           "training.eval_every=0", "training.eval_max_prompts=16", f"logging.run_dir={run_dir}",
           "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]", "logging.samples_every=1",
           "logging.samples_per_step=64", "checkpoint.every=0", "checkpoint.resume=never", "checkpoint.save_final=false",
           "checkpoint.export_hf=false"]
    env = run_in_subprocess_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert len(steps) == 3 and all(r["reward/failures"] == 0 and r["reward/timeouts"] == 0 for r in steps)
    answers = {r["question"]: r["reward_model"]["ground_truth"] for r in file_rows("train.jsonl")}
    held_out = {r["question"]: r["reward_model"]["ground_truth"] for r in file_rows("eval.jsonl")}
    samples = read_jsonl(run_dir / "samples.jsonl")
    train_samples = [s for s in samples if s["kind"] == "train"]
    assert len(train_samples) == 3 * 64
    for sample in train_samples:
        # the prompt came from the file's "question" column, the answer from the nested key
        assert sample["answer"] == answers[sample["prompt"]]
        # the reward is the example's check, applied by hand to what the model wrote
        right = sample["completion"].split("<|im_end|>")[0].strip() == sample["answer"]
        assert sample["reward"] == float(right) == sample["rewards"]["python"]
    evals = [s for s in samples if s["kind"] == "eval"]
    assert evals and all(held_out[s["prompt"]] == s["answer"] for s in evals)
    # the warm start knows this format: some answers are right from the first step, not all
    assert 0 < sum(s["reward"] for s in train_samples) < len(train_samples)
