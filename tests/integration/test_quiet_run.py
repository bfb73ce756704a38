"""A plain ``rlite train`` prints rlite's own lines only: no Python warnings about rlite's calls into
transformers, and none of transformers' progress bars, which would break the live progress line."""

from __future__ import annotations

import re

import pytest

from rlite.testing import run_in_subprocess_env
from rlite.tokenizer import build_tiny_model_dir

PYTHON_WARNING = re.compile(r"\b\w+Warning: ")
TRANSFORMERS_BARS = ("Loading weights", "Writing model shards", "Loading checkpoint shards")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def test_a_tiny_run_prints_no_warnings_and_no_transformers_progress_bars(tmp_path, model_dir, run_rlite):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{path: {model_dir}}}\ndata: {{task: addition, num_train: 32, num_eval: 4}}\n")
    result = run_rlite(
        "train", str(config), "training.steps=2", "training.eval_every=1", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4", "training.micro_batch_size=8",
        f"logging.run_dir={tmp_path / 'run'}", "logging.loggers=[jsonl]", "checkpoint.resume=never",
        "checkpoint.export_hf=true", env=run_in_subprocess_env(), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "hf_model" / "config.json").is_file()  # the export (a save) happened
    printed = result.stdout + result.stderr
    assert not PYTHON_WARNING.search(printed), printed
    for bar in TRANSFORMERS_BARS:
        assert bar not in printed, printed
    assert "step 2/2" in result.stdout  # rlite's own progress line is still there
