"""examples/own_task as a user runs it, from its README alone: ``rlite train examples/own_task/config.yaml``
from the repository root on the shipped character-level warm start, for a few steps; the data is what
make_data.py writes, the reward is the file's function applied by hand, and the recipe on SmolLM2 loads.

That the full run learns is measured, not tested (minutes of CPU): benchmarks/RESULTS.md, "Your own task".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlite.testing import read_jsonl, run_in_subprocess_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "own_task"


def file_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / name).read_text().splitlines()]


def expected_reward(completion: str, target: str) -> float:
    """The README's rule, written again: 1 for the exact reversal, else half the fraction of letters in place."""
    written = completion.split("<|im_end|>")[0].strip()
    if written == target:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(written, target)) / max(len(written), len(target), 1)


def test_shipped_data_is_what_make_data_writes_and_eval_is_held_out(tmp_path):
    script = tmp_path / "make_data.py"
    script.write_text((EXAMPLE / "make_data.py").read_text())
    subprocess.run([sys.executable, str(script)], check=True, timeout=120)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_text() == (EXAMPLE / name).read_text(), name
    train, held_out = file_rows("train.jsonl"), file_rows("eval.jsonl")
    assert len(train) == 1000 and len(held_out) == 128
    assert not {r["word"] for r in train} & {r["word"] for r in held_out}
    for row in train + held_out:
        assert row["instruction"] == f"reverse: {row['word']}" and row["target"] == row["word"][::-1]


def test_own_task_trains_through_the_cli_on_the_shipped_strings_warm_start(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlite", "train", "examples/own_task/config.yaml", "training.steps=3",
           "training.eval_every=3", "training.eval_max_prompts=32", f"logging.run_dir={run_dir}",
           "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]", "logging.samples_every=1",
           "logging.samples_per_step=256", "checkpoint.every=0", "checkpoint.resume=never", "checkpoint.save_final=false",
           "checkpoint.export_hf=false"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=run_in_subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert len(steps) == 3 and all(r["reward/failures"] == 0 and r["reward/timeouts"] == 0 for r in steps)
    targets = {r["instruction"]: r["target"] for r in file_rows("train.jsonl")}
    samples = read_jsonl(run_dir / "samples.jsonl")
    train_samples = [s for s in samples if s["kind"] == "train"]
    assert len(train_samples) == 3 * 256
    for sample in train_samples:
        assert sample["answer"] == targets[sample["prompt"]]
        # the batch holds rewards in float32
        assert sample["reward"] == pytest.approx(expected_reward(sample["completion"], sample["answer"]), rel=1e-6)
        assert sample["rewards"]["python"] == sample["reward"]
    # the warm start writes letters: some reversals are exact from the first step (GRPO has a signal), not all
    exact = sum(s["reward"] == 1.0 for s in train_samples)
    assert 0 < exact < len(train_samples)
    # accuracy counts exact reversals only (training.accuracy_threshold 1.0), partial credit does not
    first = steps[0]
    step_one = [s for s in train_samples if s["step"] == 1]
    assert first["reward/accuracy"] * len(step_one) == sum(s["reward"] == 1.0 for s in step_one)


def test_the_smollm2_recipe_is_the_same_task_on_a_hub_model(tmp_path):
    """Same data and reward, a hub name as the model: the config loads and names what the README says."""
    from rlite.tools.cli import main

    assert main(["config", str(EXAMPLE / "config_smollm2.yaml")]) == 0
    import yaml

    small = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    hub = yaml.safe_load((EXAMPLE / "config_smollm2.yaml").read_text())
    assert hub["model"]["path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub["rewards"] == small["rewards"]
    for key in ("train_files", "eval_files", "prompt_key", "answer_key"):
        assert hub["data"][key] == small["data"][key]
