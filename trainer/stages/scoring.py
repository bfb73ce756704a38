"""Stage 2 of a step: score a rollout batch with the reward functions and say which answers are right: its
:class:`~rlite.rollout.Scores`.

The reward functions see each sample as its data row plus what the rollout added
(:func:`rlite.reward_runner.reward_samples`); the batch keeps the row as loaded and the rest in typed fields.
Accuracy counts answers that are right (:func:`rlite.tasks.is_correct`: a built-in task's answer
check, else the total reward against ``training.accuracy_threshold``), not rewards above 0; a
multi-turn sample's environment decides with its ``correct`` metric when it reports one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlite.distributed import DataLayout, all_reduce_sum, from_replica_leader
from rlite.reward_runner import RewardFailureError, RewardRunner, RewardScores, reward_samples
from rlite.rollout import RolloutBatch, Scores
from rlite.tasks import DEFAULT_ACCURACY_THRESHOLD, is_correct
from rlite.workflows import mean_env_metrics


@dataclass(frozen=True)
class GreedyBaseline:
    """One greedy completion of each sample's prompt, scored (ReMax's baseline): what the rollout hands the
    scoring with its batch."""

    texts: list[str]
    """The decoded greedy completion, per sample."""
    scores: torch.Tensor
    """[B] its reward, per sample."""
    error: str | None
    """What went wrong scoring them (:attr:`RewardScores.error`; raised by :meth:`RolloutScoring.score`)."""


class RolloutScoring:
    """The reward functions of a run and its rule for a right answer; ``layout``: this rank's shard (the
    replica's leader scores, and a reward failure stops every rank)."""

    def __init__(self, rewards: RewardRunner, layout: DataLayout,
                 accuracy_threshold: float = DEFAULT_ACCURACY_THRESHOLD) -> None:  # fmt: skip
        self.rewards, self.layout, self.accuracy_threshold = rewards, layout, accuracy_threshold

    def score(self, batch: RolloutBatch, group=None, baseline: GreedyBaseline | None = None) -> tuple[Scores, dict[str, float]]:
        """The batch's :class:`Scores` (with the greedy ``baseline``'s, when the rollout drew one) and the reward
        stats. What went wrong scoring either is raised here on every rank of ``group``."""
        samples = reward_samples(batch.samples, batch.response_lengths.tolist(), batch.finish_reasons, batch.env)
        # the leader scores (a reward that times out on one rank must not split the replica)
        result = from_replica_leader(self.layout, lambda: self.rewards.score(batch.completion_texts, samples))
        self.stop_on_reward_error(result.error or (baseline.error if baseline is not None else None), group)
        scores, stats = result.scores, result.stats
        env_metrics = [None] * len(batch) if batch.env is None else batch.env.metrics
        product = Scores(
            scores=torch.tensor(scores, dtype=torch.float32),
            correct=torch.tensor([
                self.is_correct(text, row, score, metrics)
                for text, row, score, metrics in zip(batch.completion_texts, batch.samples, scores, env_metrics)
            ], dtype=torch.bool),
            reward_components=torch.tensor(result.components, dtype=torch.float32).reshape(len(scores), -1),
            baseline_texts=baseline.texts if baseline is not None else [],
            baseline_scores=baseline.scores if baseline is not None else None,
        )  # fmt: skip
        if batch.env is not None:
            stats["rollout/turns"] = sum(batch.env.turns.tolist()) / max(len(batch), 1)
            stats["rollout/env_reward"] = sum(batch.env.rewards.tolist()) / max(len(batch), 1)
            stats["rollout/observation_tokens"] = float(
                (batch.response_present - batch.response_mask).sum() / max(len(batch), 1))
            stats.update(mean_env_metrics(batch.env.metrics, "rollout/env/"))
        if baseline is not None:
            stats["reward/greedy_baseline"] = float(baseline.scores.mean()) if len(batch) else 0.0
        return product, stats

    def close(self) -> None:
        """Stop the reward functions' workers."""
        self.rewards.close()

    def score_samples(self, texts: list[str], samples: list[dict]) -> RewardScores:
        """The rewards of ``texts``; ``samples``: as the reward functions see them (:func:`reward_samples`)."""
        return self.rewards.score(texts, samples)

    def is_correct(self, text: str, row: dict, reward: float, env_metrics: dict[str, float] | None = None) -> bool:
        """For the ``*accuracy`` metrics. A multi-turn sample's text (``env_metrics`` given) holds every turn
        and observation, so the task's answer check does not apply: its environment's ``correct`` metric
        decides, or else ``reward >= training.accuracy_threshold``."""
        if env_metrics is None:
            return is_correct(text, row, reward, self.accuracy_threshold)
        return bool(env_metrics["correct"]) if "correct" in env_metrics else reward >= self.accuracy_threshold

    def stop_on_reward_error(self, error: str | None, group=None) -> None:
        """Raise :class:`RewardFailureError` on every rank when any rank's rewards passed their
        failure bound (``error``: this rank's :attr:`RewardScores.error`; one collective over ``group``,
        by default the data-parallel group, so that no rank goes on alone)."""
        group = self.layout.group if group is None else group
        failed = float(all_reduce_sum(torch.tensor([float(error is not None)]), group)[0])
        if failed:
            raise RewardFailureError(error or "the reward functions failed on another rank; see its log")
