"""What the rollout adds to a sample reaches the reward functions (``response_length``, ``finish_reason``,
a multi-turn rollout's ``env_reward``, ``turns``, ``env_metrics``) while the batch keeps its data rows
exactly as loaded and the rest in typed fields."""

from __future__ import annotations

import pytest
import torch

from rlite.distributed import DataLayout
from rlite.reward_runner import RewardEntry, RewardRunner, reward_samples
from rlite.rollout import EnvResults, RolloutBatch
from rlite.stages.scoring import RolloutScoring

ROWS = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]


def batch(env: EnvResults | None) -> RolloutBatch:
    rows = [dict(row) for row in ROWS]
    return RolloutBatch(
        prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=torch.ones(2, 3, dtype=torch.long), response_mask=torch.tensor([[1.0, 1, 1], [1, 0, 0]]),
        rollout_logprobs=torch.zeros(2, 3), group_ids=torch.tensor([0, 0]), finish_reasons=["length", "stop"],
        samples=rows, completion_texts=["x", "y"], env=env,
    )  # fmt: skip


def seen(completion, sample, cfg):
    """A reward that records what it was given and changes it."""
    cfg.append(dict(sample))
    sample["answer"] = "changed"
    return float(sample.get("env_reward", 0.0)) + sample["response_length"]


def scoring(calls: list) -> RolloutScoring:
    return RolloutScoring(RewardRunner([RewardEntry("seen", seen, calls, isolation="inline")]), DataLayout(rank=0, size=1))


def test_a_multi_turn_sample_reaches_the_rewards_with_its_environments_results_and_its_row_untouched():
    calls = []
    env = EnvResults(rewards=torch.tensor([0.5, 2.0], dtype=torch.float64), turns=torch.tensor([3, 1]),
                     metrics=[{"correct": 1.0}, {"correct": 0.0}])
    samples = batch(env)
    scores, stats = scoring(calls).score(samples)
    assert calls == [
        {"prompt": "a", "answer": "1", "env_reward": 0.5, "turns": 3, "env_metrics": {"correct": 1.0},
         "response_length": 3, "finish_reason": "length"},
        {"prompt": "b", "answer": "2", "env_reward": 2.0, "turns": 1, "env_metrics": {"correct": 0.0},
         "response_length": 1, "finish_reason": "stop"},
    ]  # fmt: skip
    assert samples.samples == ROWS  # the functions' changes stay in their copies
    assert scores.scores.tolist() == [3.5, 3.0]
    assert scores.reward_components.tolist() == [[3.5], [3.0]]
    assert scores.correct.tolist() == [True, False]  # the environment's `correct`, not the task's check
    assert stats["rollout/turns"] == 2.0 and stats["rollout/env_reward"] == 1.25
    assert stats["rollout/env/correct"] == 0.5


def test_a_single_turn_sample_has_no_environment_keys():
    calls = []
    samples = batch(None)
    scores, stats = scoring(calls).score(samples)
    assert [sorted(c) for c in calls] == [["answer", "finish_reason", "prompt", "response_length"]] * 2
    assert samples.samples == ROWS and "rollout/turns" not in stats
    assert scores.baseline_scores is None and scores.baseline_texts == []  # no greedy baseline was drawn


def test_reward_samples_wants_one_length_and_reason_per_row():
    with pytest.raises(ValueError):
        reward_samples(ROWS, [1], ["stop"])
