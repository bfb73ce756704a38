"""A user's own reward in one line of YAML, by file path, per completion or batched (TRL's form),
run end to end through ``rlite train``."""

from __future__ import annotations

import pytest

from rlite.testing import read_jsonl
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main

USER_REWARDS = '''
def length(completion, sample, scale=1.0):
    """Per completion: the response length in tokens, from the row the trainer passes."""
    return scale * sample["response_length"]


def lengths(completions, response_length, prompts, answer, **columns):
    """Batched, TRL's form: the same number from the columns."""
    assert len(prompts) == len(answer) == len(completions)
    return [float(n) for n in response_length]
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def test_file_path_rewards_per_completion_and_batched_run_end_to_end(tmp_path, model_dir, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    config = tmp_path / "run.yaml"
    config.write_text(f"""\
model: {{path: {model_dir}}}
data: {{task: addition, num_train: 64, num_eval: 8}}
training: {{steps: 2, micro_batch_size: 8, eval_every: 0}}
rollout: {{prompts_per_step: 2, samples_per_prompt: 4, max_new_tokens: 4}}
logging: {{run_dir: run, progress_bar: false, plot: false, loggers: [jsonl]}}
checkpoint: {{resume: never, save_final: false, export_hf: false}}
rewards:
  - {{name: python, args: {{function: my_rewards.py:length, kwargs: {{scale: 2.0}}}}}}
  - {{name: python, args: {{function: my_rewards.py:lengths, batched: true, weight: 0.5}}}}
""")
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(config)]) == 0
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(steps) == 2
    for row in steps:
        # both functions saw each sample's response length: reward = 2 * L + 0.5 * L
        assert row["reward/python"] == pytest.approx(2.0 * row["response/length"])
        assert row["reward/python_2"] == pytest.approx(row["response/length"])
        assert row["reward/mean"] == pytest.approx(2.5 * row["response/length"])
        assert row["reward/failures"] == 0 and row["reward/timeouts"] == 0
