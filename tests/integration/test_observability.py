"""What a user sees of a run: the rollouts it writes (``samples.jsonl``), the plain progress lines
when stdout is a pipe, and the final summary's wall time and exported-model path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlite.testing import read_jsonl, run_in_subprocess_env
from rlite.tokenizer import build_tiny_model_dir

STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def write_config(path: Path, model_dir: str, run_dir: Path) -> Path:
    path.write_text(f"""\
model: {{path: {model_dir}}}
data: {{task: addition, num_train: 64, num_eval: 4}}
rewards:
  - {{name: exact_match, args: {{weight: 2.0}}}}
  - {{name: overlong_penalty, args: {{weight: 0.5, max_length: 6, buffer: 6}}}}
rollout: {{prompts_per_step: 2, samples_per_prompt: 4, max_new_tokens: 4}}
algorithm:
  advantage: {{name: grpo, args: {{norm_by_std: false}}}}
training: {{steps: {STEPS}, micro_batch_size: 8, lr: 1.0e-3, eval_every: 0, eval_max_prompts: 4}}
checkpoint: {{resume: never, save_final: false, export_hf: true}}
logging:
  run_dir: {run_dir}
  loggers: [jsonl]
  plot: false
  log_every: 1
  samples_every: 2
  samples_per_step: 8
""")
    return path


@pytest.fixture(scope="module")
def piped_run(model_dir, tmp_path_factory):
    """``rlite train CONFIG`` with stdout a pipe: its output and its run folder."""
    tmp = tmp_path_factory.mktemp("piped")
    run_dir = tmp / "run"
    config = write_config(tmp / "run.yaml", model_dir, run_dir)
    done = subprocess.run([sys.executable, "-m", "rlite", "train", str(config)], env=run_in_subprocess_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, run_dir


def test_samples_file_matches_the_batch_and_the_metrics(piped_run):
    _, run_dir = piped_run
    metrics = {row["step"]: row for row in read_jsonl(run_dir / "metrics.jsonl")}
    rows = read_jsonl(run_dir / "samples.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    # every 2 steps and at the last; the whole batch (2 prompts x 4 samples) each time
    assert sorted({r["step"] for r in train}) == [2, 3]
    for step in (2, 3):
        batch = [r for r in train if r["step"] == step]
        assert len(batch) == 8
        for r in batch:
            assert isinstance(r["completion"], str) and r["prompt"] and r["answer"] is not None
            parts = r["rewards"]
            assert parts["overlong_penalty"] == pytest.approx(-r["response_length"] / 6)
            assert parts["exact_match"] in (0.0, 1.0)
            assert r["reward"] == pytest.approx(2.0 * parts["exact_match"] + 0.5 * parts["overlong_penalty"])
        # the rewards the trainer logged are these rewards
        assert sum(r["reward"] for r in batch) / 8 == pytest.approx(metrics[step]["reward/mean"], abs=1e-6)
        penalty = sum(r["rewards"]["overlong_penalty"] for r in batch) / 8
        assert penalty == pytest.approx(metrics[step]["reward/overlong_penalty"], abs=1e-6)
        assert sum(r["response_length"] for r in batch) / 8 == pytest.approx(metrics[step]["response/length"])
        # advantages: reward minus its group's mean (grpo without std normalisation)
        groups = {}
        for r in batch:
            groups.setdefault(r["group"], []).append(r)
        assert len(groups) == 2
        for members in groups.values():
            mean = sum(m["reward"] for m in members) / len(members)
            for m in members:
                assert m["advantage"] == pytest.approx(m["reward"] - mean, abs=1e-5)


def test_samples_file_holds_the_evaluations_generations(piped_run):
    _, run_dir = piped_run
    metrics = {row["step"]: row for row in read_jsonl(run_dir / "metrics.jsonl")}
    evals = [r for r in read_jsonl(run_dir / "samples.jsonl") if r["kind"] == "eval"]
    assert sorted({r["step"] for r in evals}) == [0, STEPS]  # the baseline and the final evaluation
    for step in (0, STEPS):
        for mode in ("greedy", "sampled"):
            rows = [r for r in evals if r["step"] == step and r["mode"] == mode]
            assert len(rows) == 4
            mean = sum(r["reward"] for r in rows) / 4
            assert mean == pytest.approx(metrics[step][f"eval/{mode}_reward"], abs=1e-6)


def test_piped_stdout_gets_plain_progress_lines_and_the_final_summary(piped_run):
    stdout, run_dir = piped_run
    assert "\x1b" not in stdout, "no terminal escape codes in a pipe"
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == [f"step {s}/{STEPS}" for s in range(1, STEPS + 1)]
    metrics = {row["step"]: row for row in read_jsonl(run_dir / "metrics.jsonl")}
    for step, line in zip(range(1, STEPS + 1), lines):
        assert f"reward {metrics[step]['reward/mean']:.3f}" in line
        assert "s/step" in line and "elapsed 0:" in line and "eta 0:" in line
    assert f"eval acc {metrics[STEPS]['eval/greedy_accuracy']:.3f}" in lines[-1]
    exported = (run_dir / "hf_model").resolve()
    assert (exported / "config.json").is_file()
    final = [line for line in stdout.splitlines() if line.startswith("rlite: ")]
    assert len(final) == 1 and f"{STEPS} steps done in 0:" in final[0]
    assert f"model exported to {exported}" in final[0]
    assert final[0].endswith(f"(talk to it: rlite chat {run_dir})")
