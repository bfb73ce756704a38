"""Stage 1-2 of a step: sample completions from the engine and score them with the rewards.

With DAPO's dynamic sampling, groups whose rewards are all equal are dropped and more prompts are
drawn until every rank has its quota of groups. The held-out evaluation (greedy and sampled accuracy)
lives here too: it is a rollout without training. Accuracy counts answers that are right
(:func:`rlite.tasks.is_correct`: a built-in task's answer check, else the total reward against
``training.accuracy_threshold``), not rewards above 0.

Memory: the engine holds its weights and KV cache only from a weight sync to the end of the next
rollout. :meth:`Rollouts.collect` releases them as soon as the batch is complete, so that the
log-probs and the update have the device to themselves; the sync (:mod:`rlite.stages.sync`) takes
them back. An evaluation runs between a sync and the next rollout, on memory the engine holds.
"""

from __future__ import annotations

import contextlib

import torch

from rlite.config import AlgorithmConfig, ConfigError, RolloutConfig
from rlite.data import PromptSampler
from rlite.distributed import DataLayout, all_gather_objects, all_reduce_sum, broadcast_object
from rlite.drafts import SpeculativeDraft
from rlite.engines.base import RolloutEngine, SamplingParams, SpeculationStats
from rlite.metrics import StepTimer
from rlite.rewards import RewardFailureError, RewardRunner, RewardScores, is_count_stat
from rlite.rollout import RolloutBatch, build_rollout_batch, concat_batches
from rlite.samples import eval_sample_rows
from rlite.stages.partial import SegmentedGeneration
from rlite.tasks import DEFAULT_ACCURACY_THRESHOLD, is_correct
from rlite.workflows import TurnRunner, mean_env_metrics, trajectories_to_completions


def sampling_params(rollout: RolloutConfig, *, seed: int, n: int | None = None, greedy: bool = False) -> SamplingParams:
    return SamplingParams(
        n=rollout.samples_per_prompt if n is None else n,
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        greedy=greedy,
        seed=seed,
    )


def hash_seed(*parts: int) -> int:
    """A deterministic 31-bit seed from integers (same on every run and resume)."""
    value = 0x9E3779B1
    for part in parts:
        value = (value * 1000003) ^ (int(part) & 0xFFFFFFFF)
        value &= 0xFFFFFFFFFFFF
    return value % (2**31 - 1)


class Rollouts:
    """What sampling a step needs: the engine, the prompts, the rewards and the tokenizer."""

    def __init__(self, engine: RolloutEngine, sampler: PromptSampler, rewards: RewardRunner, tokenizer,
                 rollout: RolloutConfig, algorithm: AlgorithmConfig, seed: int, layout: DataLayout, hooks,
                 timer: StepTimer) -> None:
        self.engine, self.sampler, self.rewards, self.tokenizer = engine, sampler, rewards, tokenizer
        self.rollout, self.algorithm, self.seed, self.layout, self.hooks, self.timer = (
            rollout, algorithm, seed, layout, hooks, timer)
        self.accuracy_threshold = DEFAULT_ACCURACY_THRESHOLD
        """Total reward from which a data-file row counts as correct (``training.accuracy_threshold``)."""
        self.record_routing = False
        """Ask the engine for the experts of every MoE token (routing replay and its metrics)."""
        self.speculating = False
        """The engine decodes with a speculative draft: :attr:`speculation` counts what it did."""
        self.top_logprobs = 0
        """The policy's top log-probs per generated token the draft learns from (0: none)."""
        self.speculation: SpeculationStats | None = None
        """What speculative decoding did in the rollout of the batch :meth:`collect` returned last (all its
        rounds; this rank's engine)."""
        self.sampling_speculation: SpeculationStats | None = None
        """What speculative decoding has done so far in the batch :meth:`sample` is drawing (with
        asynchronous rollouts, a step ahead of :attr:`speculation`)."""
        self.eval_sample_count = 0
        """Generations per mode an evaluation keeps in :attr:`eval_samples` (``logging.samples_per_step``)."""
        self.eval_samples: list[dict] = []
        """The last evaluation's first generations as sample rows (:mod:`rlite.samples`; the replica leader's)."""
        self.baseline_reward_error: str | None = None
        """What went wrong scoring the greedy baselines of the batch being collected (:meth:`score` raises it)."""
        self.greedy_baseline = False
        """Also generate one greedy completion per prompt and score it (``batch.baseline_scores``): the
        advantage estimator registered with ``needs_greedy_baseline=True`` (ReMax)."""
        self.turns: TurnRunner | None = None
        """A multi-turn workflow's runner (:mod:`rlite.workflows`); ``None``: one completion per sample."""
        self.between_turns = None
        """Called between the turns of a multi-turn rollout (asynchronous rollouts let a weight sync in)."""
        self.partial: SegmentedGeneration | None = None
        """Samples the training rollouts in segments that a weight sync may come between (partial rollouts,
        ``rollout.partial_segment_tokens``); ``None``: each engine call is sampled whole."""
        self.sample_group = layout.group
        """The process group of :meth:`sample`'s collectives: the data-parallel group, or, when a producer
        thread samples (asynchronous rollouts), a group of its own beside the trainer's."""

    def use_draft(self, draft: SpeculativeDraft | None, engine: RolloutEngine, engine_name: str) -> None:
        """Decode with ``draft`` from now on: check that the engine runs it and can serve what it needs."""
        if draft is None:
            return
        if self.layout.leader and draft.spec.method not in engine.capabilities.draft_methods:
            raise ConfigError(
                f"rollout.draft: the {engine_name!r} engine cannot run a {draft.spec.method!r} draft "
                f"(it runs: {', '.join(engine.capabilities.draft_methods) or 'no drafts'}); set rollout.draft=none"
            )
        if self.record_routing:
            raise ConfigError(
                "rollout.draft: MoE routing replay and routing metrics record the engine's routing token by token, "
                "which speculative verification does not report; set rollout.draft=none, or "
                "algorithm.routing_replay=none and algorithm.routing_metrics=false"
            )
        self.speculating, self.top_logprobs = True, int(draft.rollout_top_logprobs)

    def use_workflow(self, runner: TurnRunner | None) -> None:
        """Sample every trajectory turn by turn against its environment (``None``: single turn)."""
        if runner is not None and self.record_routing:
            raise ConfigError(
                "rollout.workflow: MoE routing replay and routing metrics are not recorded for multi-turn rollouts; "
                "set algorithm.routing_replay=none and algorithm.routing_metrics=false"
            )
        self.turns = runner

    @property
    def per_rank(self) -> int:
        """Prompts per data-parallel shard."""
        return self.rollout.prompts_per_step // self.layout.size

    def _from_leader(self, make):
        """``make()`` on the replica's leader, its result on every rank of the replica."""
        layout = self.layout
        if layout.replica_size == 1:
            return make()
        return broadcast_object(make() if layout.leader else None, layout.replica_leader, layout.replica_group)

    def exclusive_engine(self, version: int):
        """A context that holds the engine for a weight sync to ``version`` (asynchronous rollouts)."""
        return contextlib.nullcontext()

    def weights_synced(self, version: int) -> None:
        """The engine samples with ``version`` from now on (asynchronous rollouts wait for it)."""

    def close(self) -> None:
        """Stop whatever samples in the background (asynchronous rollouts)."""

    def checkpoint_state(self, step: int) -> dict:
        """What a checkpoint of ``step`` keeps of the sampling: the prompt sampler's position after the
        batches trained so far (``sampler``); asynchronous rollouts add the batches sampled beyond it."""
        return {"sampler": self.sampler.state_dict()}

    def resume_ahead(self, ahead: dict, step: int) -> None:
        """Batches that an asynchronous run's checkpoint of ``step`` kept for the steps after it: a
        synchronous run samples those steps again, from the position the checkpoint's ``sampler`` holds."""

    def collect(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's batch of the step (:meth:`sample`), then the engine releases its memory: the
        log-probs and the update that follow get it, and the weight sync takes it back."""
        batch, stats = self.sample(step)
        self.speculation = self.sampling_speculation
        self.engine.release_memory()
        return batch, stats

    def sample(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate, score, and with dynamic sampling (DAPO) drop groups whose rewards are all equal
        and draw more prompts until every rank has its quota.

        Rounds are collective (every rank draws while any rank is short), so the prompt samplers of
        all ranks stay in step. A batch still short after ``dynamic_sampling_max_rounds`` is topped up
        with dropped groups, keeping the batch size (and so the loss normalisation) fixed.
        """
        algo, per_rank = self.algorithm, self.per_rank
        kept, spare, stats_sum, rounds = [], [], {}, 0
        self.sampling_speculation = SpeculationStats() if self.speculating else None
        while True:
            rounds += 1
            with self.timer.phase("generation"):
                batch = self.generate(next(self.sampler), step, rounds - 1)
            self.hooks.after_rollout(step=step, batch=batch)
            with self.timer.phase("reward"):
                stats = self.score(batch)
            self.hooks.after_rewards(step=step, batch=batch)
            for key, value in stats.items():
                stats_sum[key] = stats_sum.get(key, 0.0) + value
            if not algo.dynamic_sampling:
                return batch, stats
            for group in split_groups(batch):
                (kept if float(group.scores.max() - group.scores.min()) > 0 else spare).append(group)
            short = float(len(kept) < per_rank)
            still_short = float(all_reduce_sum(torch.tensor([short]), self.sample_group)[0]) > 0
            if not still_short or rounds >= algo.dynamic_sampling_max_rounds:
                break
        dropped = len(spare)
        groups = (kept + spare)[:per_rank]
        batch = concat_batches(groups, self.tokenizer.pad_token_id)
        batch.group_ids = self.layout.rank * per_rank + torch.arange(len(batch)) // self.rollout.samples_per_prompt
        stats = {key: value if is_count_stat(key) else value / rounds
                 for key, value in stats_sum.items()}
        stats["dynamic_sampling/rounds"] = float(rounds)
        stats["dynamic_sampling/dropped_groups"] = float(dropped)
        stats["dynamic_sampling/kept_fraction"] = min(len(kept), per_rank) / per_rank
        return batch, stats

    def generate(self, prompts: list, step: int, round_index: int = 0) -> RolloutBatch:
        """This shard's samples: generated by the replica's leader, the same batch on its other ranks."""
        return self._from_leader(lambda: self._generate(prompts, step, round_index))

    def _generate(self, prompts: list, step: int, round_index: int) -> RolloutBatch:
        extra_round = (round_index,) if round_index else ()  # round 0 keeps the seed of a run without dynamic sampling
        params = sampling_params(self.rollout, seed=hash_seed(self.seed, step, self.layout.rank, *extra_round))
        params.return_routed_experts = self.record_routing
        params.top_logprobs = self.top_logprobs
        engine = self.engine
        if self.turns is not None:
            return self._generate_turns(prompts, params, step, extra_round)
        completions = (self.partial or engine).generate([p.prompt_ids for p in prompts], params)
        if self.speculating:
            self.sampling_speculation += engine.speculation_stats()
        self.check_versions(completions, step)
        batch = build_rollout_batch(
            [p.prompt_ids for p in prompts],
            completions,
            [p.row for p in prompts],
            group_offset=self.layout.rank * self.per_rank,
            pad_token_id=self.tokenizer.pad_token_id,
            fixed_width=self.rollout.max_new_tokens if self.rollout.true_on_policy else None,
        )
        batch.completion_texts = self.tokenizer.batch_decode(
            [c.token_ids for c in completions], skip_special_tokens=True
        )
        if self.greedy_baseline:
            self.greedy_rollout(batch, prompts, completions)
        return batch

    def check_versions(self, completions, step: int) -> None:
        engine = self.engine
        stale = {c.weight_version for c in completions} - {engine.weight_version}
        if stale or engine.weight_version != step - 1:
            raise RuntimeError(
                f"step {step}: the engine sampled with weight version(s) {sorted(stale) or engine.weight_version}, "
                f"expected {step - 1}: a weight sync was lost"
            )

    def _generate_turns(self, prompts: list, params: SamplingParams, step: int, extra_round: tuple) -> RolloutBatch:
        """A multi-turn rollout: the trajectories' tokens, sampled (in the loss) and observed (not)."""
        trajectories = self.run_turns(prompts, params, lambda turn: hash_seed(self.seed, step, self.layout.rank,
                                                                             *extra_round, 1 << 20 | turn),
                                      self.between_turns, self.partial)
        completions, loss_masks = trajectories_to_completions(trajectories)
        self.check_versions(completions, step)
        return self.trajectory_batch(trajectories, prompts, completions, loss_masks)

    def run_turns(self, prompts: list, params: SamplingParams, later_seed, between_turns=None, engine=None):
        first_seed = params.seed  # the first turn samples as a single-turn rollout would
        return self.turns.run(engine or self.engine, [p.prompt_ids for p in prompts], [p.row for p in prompts], params,
                              lambda turn: first_seed if turn == 0 else later_seed(turn), between_turns)

    def trajectory_batch(self, trajectories, prompts: list, completions, loss_masks) -> RolloutBatch:
        for row, completion in enumerate(completions):
            completion.prompt_index = row  # one prompt row per trajectory: its first observation may differ
        samples = [dict(prompts[t.prompt_index].row, env_reward=t.reward, turns=t.turns, env_metrics=t.metrics)
                   for t in trajectories]
        batch = build_rollout_batch(
            [t.context for t in trajectories], completions, samples, group_offset=0,
            pad_token_id=self.tokenizer.pad_token_id, loss_masks=loss_masks,
        )  # fmt: skip
        batch.group_ids = self.layout.rank * self.per_rank + torch.tensor([t.prompt_index for t in trajectories])
        versions = torch.full(batch.response_ids.shape, -1, dtype=torch.long)
        for row, t in enumerate(trajectories):
            versions[row, : len(t.weight_versions)] = torch.tensor(t.weight_versions, dtype=torch.long)
        batch.token_weight_versions = versions
        batch.completion_texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        return batch

    def greedy_rollout(self, batch: RolloutBatch, prompts: list, completions: list) -> None:
        """One greedy completion per prompt from the same weights, scored like the samples (with its own
        length): ``batch.baseline_texts`` and ``batch.baseline_scores``, per sample (ReMax's baseline)."""
        greedy = self.engine.generate([p.prompt_ids for p in prompts], sampling_params(self.rollout, seed=0, n=1, greedy=True))
        by_prompt = {c.prompt_index: c for c in greedy}
        ordered = [by_prompt[i] for i in range(len(prompts))]
        texts = self.tokenizer.batch_decode([c.token_ids for c in ordered], skip_special_tokens=True)
        rows = [dict(p.row, response_length=len(c.token_ids), finish_reason=c.finish_reason)
                for p, c in zip(prompts, ordered)]
        result = self.rewards.score(texts, rows)  # timed with the generation
        self.baseline_reward_error = result.error  # raised on every rank by score(), a collective
        batch.baseline_texts = [texts[c.prompt_index] for c in completions]
        batch.baseline_scores = torch.tensor([result.scores[c.prompt_index] for c in completions], dtype=torch.float32)

    def score(self, batch: RolloutBatch) -> dict[str, float]:
        # each sample gets its own copy of the data row plus what length-aware rewards need
        batch.samples = [
            dict(sample, response_length=int(length), finish_reason=reason)
            for sample, length, reason in zip(batch.samples, batch.response_lengths.tolist(), batch.finish_reasons)
        ]
        # the leader scores (a reward that times out on one rank must not split the replica)
        result = self._from_leader(lambda: self.rewards.score(batch.completion_texts, batch.samples))
        baseline_error, self.baseline_reward_error = self.baseline_reward_error, None
        self.stop_on_reward_error(result.error or baseline_error, self.sample_group)
        scores, stats = result.scores, result.stats
        batch.scores = torch.tensor(scores, dtype=torch.float32)
        batch.reward_components = torch.tensor(result.components, dtype=torch.float32).reshape(len(scores), -1)
        batch.correct = torch.tensor([
            self.is_correct(text, sample, score)
            for text, sample, score in zip(batch.completion_texts, batch.samples, scores)
        ], dtype=torch.bool)  # fmt: skip
        if self.turns is not None:
            stats["rollout/turns"] = sum(s["turns"] for s in batch.samples) / max(len(batch), 1)
            stats["rollout/env_reward"] = sum(s["env_reward"] for s in batch.samples) / max(len(batch), 1)
            stats["rollout/observation_tokens"] = float(
                (batch.response_present - batch.response_mask).sum() / max(len(batch), 1))
            stats.update(mean_env_metrics([s["env_metrics"] for s in batch.samples], "rollout/env/"))
        if batch.baseline_scores is not None:
            stats["reward/greedy_baseline"] = float(batch.baseline_scores.mean()) if len(batch) else 0.0
        return stats

    def is_correct(self, text: str, sample: dict, reward: float) -> bool:
        """For the ``*accuracy`` metrics. A multi-turn sample's text holds every turn and observation, so
        the task's answer check does not apply: its environment's ``correct`` metric decides, or else
        ``reward >= training.accuracy_threshold``."""
        if self.turns is None:
            return is_correct(text, sample, reward, self.accuracy_threshold)
        metrics = sample.get("env_metrics") or {}
        return bool(metrics["correct"]) if "correct" in metrics else reward >= self.accuracy_threshold

    def stop_on_reward_error(self, error: str | None, group=None) -> None:
        """Raise :class:`RewardFailureError` on every rank when any rank's rewards passed their
        failure bound (``error``: this rank's :attr:`RewardScores.error`; one collective over ``group``,
        by default the data-parallel group, so that no rank goes on alone)."""
        group = self.layout.group if group is None else group
        failed = float(all_reduce_sum(torch.tensor([float(error is not None)]), group)[0])
        if failed:
            raise RewardFailureError(error or "the reward functions failed on another rank; see its log")

    def score_eval(self, step: int, mode: str, items: list, texts: list[str], samples: list[dict],
                   ) -> tuple[RewardScores, list[bool]]:  # fmt: skip
        """Score held-out generations, keep the first ones as sample rows, and say which answers are right."""
        result = self.rewards.score(texts, samples)
        self.eval_samples += eval_sample_rows(step, mode, items, texts, result.scores, self.eval_sample_count)
        correct = [self.is_correct(text, sample, reward) for text, sample, reward in zip(texts, samples, result.scores)]
        return result, correct

    @torch.no_grad()
    def evaluate(self, eval_prompts, step: int, max_prompts: int) -> dict[str, float]:
        """Greedy and sampled accuracy on the held-out prompts (each rank its share; global means)."""
        if not eval_prompts:
            return {}
        layout = self.layout
        items = list(eval_prompts)[:max_prompts][layout.rank :: layout.size]
        out = {}
        self.eval_samples = []
        failures = timeouts = 0.0
        for mode, greedy in (("greedy", True), ("sampled", False)):
            params = sampling_params(self.rollout, seed=hash_seed(self.seed, step, layout.rank, 7), n=1, greedy=greedy)

            def score_items(params=params, mode=mode) -> tuple[RewardScores, list[bool], list[dict]]:
                # called with no items too: an engine serving several ranks samples them all in one call
                if self.turns is not None:  # each held-out prompt played through its environment
                    trajectories = self.run_turns(items, params, lambda turn: hash_seed(params.seed, turn))
                    texts = self.tokenizer.batch_decode([t.token_ids for t in trajectories], skip_special_tokens=True)
                    rows = [dict(p.row, env_reward=t.reward, turns=t.turns, env_metrics=t.metrics)
                            for p, t in zip(items, trajectories)]
                    return *self.score_eval(step, mode, items, texts, rows), [t.metrics for t in trajectories]
                completions = self.engine.generate([p.prompt_ids for p in items], params)
                texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
                samples = [dict(p.row, response_length=len(c.token_ids), finish_reason=c.finish_reason)
                           for p, c in zip(items, completions)]
                return *self.score_eval(step, mode, items, texts, samples), []

            result, correct, env_metrics = self._from_leader(score_items)
            self.stop_on_reward_error(result.error)
            scores = result.scores
            totals = all_reduce_sum(
                torch.tensor([float(sum(correct)), float(sum(scores)), float(len(scores)),
                              result.stats["reward/failures"], result.stats["reward/timeouts"]]), layout.group
            )
            n = max(float(totals[2]), 1.0)
            out[f"eval/{mode}_accuracy"] = float(totals[0]) / n
            out[f"eval/{mode}_reward"] = float(totals[1]) / n
            if self.turns is not None:  # the environments' own numbers, over every rank's prompts
                gathered = [m for part in all_gather_objects(env_metrics, layout.group) for m in part]
                out.update(mean_env_metrics(gathered, f"eval/{mode}_env/"))
            failures += float(totals[3])
            timeouts += float(totals[4])
        out["eval/reward_failures"], out["eval/reward_timeouts"] = failures, timeouts
        return out


def split_groups(batch: RolloutBatch) -> list[RolloutBatch]:
    """One batch per group (groups are contiguous rows with equal ``group_ids``)."""
    ids = batch.group_ids.tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]] + [len(ids)]
    return [batch.select(slice(a, b)) for a, b in zip(starts, starts[1:])]
