"""What a run tells its user as it goes and at its end: a run whose reward never fires (a random tiny
model on addition) warns once, says so in its progress lines and counts the steps in its summary; a
run with a speculative draft shows the draft's acceptance in its progress lines and its summary."""

from __future__ import annotations

import re

import pytest

from rlite.testing import read_jsonl, run_in_subprocess_env
from rlite.tokenizer import build_tiny_model_dir

STEPS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def train(run_rlite, model_dir, tmp_path, *overrides: str):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{path: {model_dir}}}\ndata: {{task: addition, num_train: 64, num_eval: 4}}\n")
    run_dir = tmp_path / "run"
    result = run_rlite(
        "train", str(config), f"training.steps={STEPS}", "training.eval_every=0", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4", "training.micro_batch_size=8",
        f"logging.run_dir={run_dir}", "logging.loggers=[jsonl]", "logging.plot=false", "logging.log_every=1",
        "checkpoint.resume=never", "checkpoint.save_final=false", "checkpoint.export_hf=false", *overrides,
        env=run_in_subprocess_env(COLUMNS="400"), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [row for row in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in row]
    progress = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(rows) == len(progress) == STEPS
    return result, rows, progress


def test_a_run_that_cannot_learn_says_why(model_dir, tmp_path, run_rlite):
    result, rows, progress = train(run_rlite, model_dir, tmp_path)
    assert all(row["advantage/zero_variance_groups"] == 1.0 and row["reward/mean"] == 0.0 for row in rows)
    warnings = [line for line in result.stderr.splitlines() if "no learning signal" in line]
    assert len(warnings) == 1 and "for 5 steps in a row" in warnings[0]  # after 5 steps, then not again so soon
    assert "No sample earned a reward" in warnings[0]
    assert all("no signal in 100% of groups" in line for line in progress)
    assert re.search(rf"steps_without_learning_signal\s+│ {STEPS} of {STEPS} ", result.stdout), result.stdout
    assert "draft" not in result.stdout  # no draft, no acceptance


def test_a_run_with_a_draft_shows_its_acceptance(model_dir, tmp_path, run_rlite):
    result, rows, progress = train(run_rlite, model_dir, tmp_path, "rollout.draft=ngram")
    for row, line in zip(rows, progress):
        assert f"draft accept {row['spec/acceptance_rate']:.2f}" in line
    mean = sum(row["spec/acceptance_rate"] for row in rows) / STEPS
    assert re.search(rf"draft_acceptance_mean\s+│ {mean:.4f} ", result.stdout), result.stdout
    assert re.search(rf"draft_acceptance_final \(step {STEPS}\)\s+│ {rows[-1]['spec/acceptance_rate']:.4f} ",
                     result.stdout)  # fmt: skip
