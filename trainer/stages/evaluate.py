"""The held-out evaluation: greedy and sampled accuracy on the held-out prompts, a rollout without
training. It runs between a weight sync and the next rollout, on memory the engine holds (the loop
holds the engine for it: :meth:`rlite.stages.collect.Rollouts.exclusive_engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlite.distributed import DataLayout, all_gather_objects, all_reduce_sum, from_replica_leader
from rlite.engines.base import RolloutEngine
from rlite.metrics import MetricsSink, merge_reported, reported_values
from rlite.reward_runner import RewardScores, reward_samples
from rlite.rollout import EnvResults
from rlite.samples import eval_sample_rows
from rlite.stages.collect import RolloutOptions, hash_seed, play_turns, sampling_params
from rlite.stages.scoring import RolloutScoring
from rlite.workflows import mean_env_metrics


@dataclass
class EvalResult:
    """What :meth:`Evaluation.evaluate` returns."""

    metrics: dict[str, float] = field(default_factory=dict)
    """``eval/{greedy,sampled}_{accuracy,reward}``, the reward failures and the environments' numbers
    (global means over every rank's prompts)."""
    samples: list[dict] = field(default_factory=list)
    """The first generations of each mode as sample rows (:mod:`rlite.samples`; the replica leader's)."""


@dataclass
class _Scored:
    """One mode's held-out generations, scored (what the replica's leader hands its replica)."""

    rewards: RewardScores
    correct: list[bool]
    samples: list[dict]
    env_metrics: list[dict[str, float]]


class Evaluation:
    """Greedy and sampled accuracy on the held-out prompts (each rank its share; global means).

    ``prompts``: the held-out split (``None``: none), of which the first ``max_prompts`` are evaluated
    (``training.eval_max_prompts``); ``sample_count``: generations per mode kept as sample rows
    (``logging.samples_per_step``; 0 where nobody writes them)."""

    def __init__(self, engine: RolloutEngine, tokenizer, scoring: RolloutScoring, options: RolloutOptions,
                 layout: DataLayout, prompts=None, max_prompts: int | None = None, sample_count: int = 0,
                 engine_metrics: MetricsSink | None = None) -> None:  # fmt: skip
        self.engine, self.tokenizer, self.scoring = engine, tokenizer, scoring
        self.options, self.layout, self.sample_count = options, layout, sample_count
        self.prompts, self.max_prompts = prompts, max_prompts
        self.engine_metrics = engine_metrics
        """Where the engine reports metrics: what it reports during the evaluation goes to ``eval/<name>``."""

    @property
    def has_prompts(self) -> bool:
        return bool(self.prompts)

    @torch.no_grad()
    def evaluate(self, step: int) -> EvalResult:
        """The evaluation after the weights of ``step``: its metrics and sample rows."""
        if not self.prompts:
            return EvalResult()
        # what the engine reported before (the weight sync) belongs to the next rollout's row, not here
        pending = self.engine_metrics.drain() if self.engine_metrics is not None else {}
        try:
            result = self._evaluate(self.prompts, step, self.max_prompts)
        finally:
            reported = self.engine_metrics.drain() if self.engine_metrics is not None else {}
            if self.engine_metrics is not None:
                self.engine_metrics.merge(pending)
        if self.engine_metrics is not None:  # every rank has a sink (the engine context), so every rank gathers
            merged = merge_reported(all_gather_objects(reported, self.layout.group))
            result.metrics.update({f"eval/{name}": value for name, value in reported_values(merged).items()})
        return result

    def _evaluate(self, eval_prompts, step: int, max_prompts: int | None) -> EvalResult:
        layout, options = self.layout, self.options
        items = list(eval_prompts)[:max_prompts][layout.rank :: layout.size]
        out, kept = {}, []
        failures = timeouts = 0.0
        for mode, greedy in (("greedy", True), ("sampled", False)):
            params = sampling_params(options.rollout, seed=hash_seed(options.seed, step, layout.rank, 7), n=1, greedy=greedy)
            # called with no items too: an engine serving several ranks samples them all in one call
            scored = from_replica_leader(layout, lambda params=params, mode=mode: self.score_items(items, params, step, mode))
            kept += scored.samples
            result = scored.rewards
            self.scoring.stop_on_reward_error(result.error)
            scores = result.scores
            totals = all_reduce_sum(
                torch.tensor([float(sum(scored.correct)), float(sum(scores)), float(len(scores)),
                              result.stats["reward/failures"], result.stats["reward/timeouts"]]), layout.group
            )
            n = max(float(totals[2]), 1.0)
            out[f"eval/{mode}_accuracy"] = float(totals[0]) / n
            out[f"eval/{mode}_reward"] = float(totals[1]) / n
            if options.turns is not None:  # the environments' own numbers, over every rank's prompts
                gathered = [m for part in all_gather_objects(scored.env_metrics, layout.group) for m in part]
                out.update(mean_env_metrics(gathered, f"eval/{mode}_env/"))
            failures += float(totals[3])
            timeouts += float(totals[4])
        out["eval/reward_failures"], out["eval/reward_timeouts"] = failures, timeouts
        return EvalResult(out, kept)

    def score_items(self, items: list, params, step: int, mode: str) -> _Scored:
        """Generate for the held-out ``items`` (each played through its environment, multi-turn), score,
        and say which answers are right."""
        rows = [p.row for p in items]
        if self.options.turns is not None:
            trajectories = play_turns(self.options.turns, self.engine, items, params, lambda turn: hash_seed(params.seed, turn))
            texts = self.tokenizer.batch_decode([t.token_ids for t in trajectories], skip_special_tokens=True)
            env = EnvResults.of(trajectories)
            samples = reward_samples(rows, [sum(t.loss_mask) for t in trajectories],
                                     [t.finish_reason for t in trajectories], env)  # fmt: skip
            env_metrics, per_sample = env.metrics, env.metrics
        else:
            completions = self.engine.generate([p.prompt_ids for p in items], params)
            texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
            samples = reward_samples(rows, [len(c.token_ids) for c in completions], [c.finish_reason for c in completions])
            env_metrics, per_sample = [], [None] * len(items)  # no environment: the task's answer check
        result = self.scoring.score_samples(texts, samples)
        correct = [self.scoring.is_correct(text, row, reward, metrics)
                   for text, row, reward, metrics in zip(texts, rows, result.scores, per_sample)]  # fmt: skip
        kept = eval_sample_rows(step, mode, items, texts, result.scores, self.sample_count)
        return _Scored(result, correct, kept, env_metrics)
