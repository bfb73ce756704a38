"""Stage 1-2 of a step: sample completions from the engine and score them with the rewards.

With DAPO's dynamic sampling, groups whose rewards are all equal are dropped and more prompts are
drawn until every rank has its quota of groups. Three parts, each built whole by its constructor:
:class:`RolloutOptions` (how the run samples, settled before the rollouts are built), :class:`Rollouts`
(sampling a step's batch) and :class:`~rlite.stages.scoring.RolloutScoring` (rewards and accuracy);
the held-out evaluation is :class:`~rlite.stages.evaluate.Evaluation`.

Memory: the engine holds its weights and KV cache only from a weight sync to the end of the next
rollout. :meth:`Rollouts.collect` releases them as soon as the batch is complete, so that the
log-probs and the update have the device to themselves; the sync (:mod:`rlite.stages.sync`) takes
them back. An evaluation runs between a sync and the next rollout, on memory the engine holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from rlite.config import ConfigError, RolloutConfig
from rlite.data import PromptSampler
from rlite.distributed import DataLayout, all_reduce_sum, from_replica_leader
from rlite.engines.base import RolloutEngine, SamplingParams, SpeculationStats
from rlite.metrics import MetricsSink, Reported, StepTimer
from rlite.reward_runner import is_count_stat, reward_samples
from rlite.rollout import EnvResults, RolloutBatch, ScoredBatch, build_rollout_batch, concat_batches
from rlite.stages.partial import SegmentedGeneration
from rlite.stages.scoring import GreedyBaseline, RolloutScoring
from rlite.workflows import Trajectory, TurnRunner, trajectories_to_completions


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


@dataclass(frozen=True)
class RolloutOptions:
    """How a run samples: the rollout config and what the run's other choices ask of the rollouts
    (settled by :func:`rlite.run.build.build_run` before the rollouts are built)."""

    rollout: RolloutConfig
    seed: int
    """``training.seed``: every engine call's seed derives from it, the step and the rank."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and draw more prompts (``algorithm.dynamic_sampling``)."""
    dynamic_sampling_max_rounds: int = 1
    """Rounds of drawing before a short batch is topped up with dropped groups."""
    greedy_baseline: bool = False
    """Also generate one greedy completion per prompt and score it (``batch.baseline_scores``): the
    advantage estimator registered with ``needs_greedy_baseline=True`` (ReMax)."""
    record_routing: bool = False
    """Ask the engine for the experts of every MoE token (routing replay and its metrics)."""
    speculating: bool = False
    """The engine decodes with a speculative draft: :attr:`Rollouts.speculation` counts what it did."""
    top_logprobs: int = 0
    """The policy's top log-probs per generated token the draft learns from (0: none)."""
    turns: TurnRunner | None = None
    """A multi-turn workflow's runner (:mod:`rlite.workflows`); ``None``: one completion per sample."""

    def __post_init__(self) -> None:
        if self.speculating and self.record_routing:
            raise ConfigError(
                "rollout.draft: MoE routing replay and routing metrics record the engine's routing token by token, "
                "which speculative verification does not report; set rollout.draft=none, or "
                "algorithm.routing_replay=none and algorithm.routing_metrics=false"
            )
        if self.turns is not None and self.record_routing:
            raise ConfigError(
                "rollout.workflow: MoE routing replay and routing metrics are not recorded for multi-turn rollouts; "
                "set algorithm.routing_replay=none and algorithm.routing_metrics=false"
            )


@dataclass(frozen=True)
class Rollout:
    """Stages 1-2's product (:meth:`Rollouts.collect`): this rank's scored batch of a step, and what was
    measured while it was drawn."""

    batch: ScoredBatch
    reward_stats: dict[str, float]
    """The rewards' and the sampling's statistics (this rank's; the report reduces them over ranks)."""
    speculation: SpeculationStats | None = None
    """What speculative decoding did in its rollout (all its rounds; this rank's engine); ``None``: no draft."""
    engine_report: Reported = field(default_factory=dict)
    """What the engine reported (its ``EngineContext.metrics``) since the batch before: its rollout, and the
    weight sync before it."""


def play_turns(turns: TurnRunner, engine, prompts: list, params: SamplingParams, later_seed: Callable[[int], int],
               between_turns: Callable[[], None] | None = None) -> list[Trajectory]:
    """Every prompt played turn by turn through its environment; the first turn samples with
    ``params.seed``, as a single-turn rollout would, turn ``k`` with ``later_seed(k)``."""
    first_seed = params.seed
    return turns.run(engine, [p.prompt_ids for p in prompts], [p.row for p in prompts], params,
                     lambda turn: first_seed if turn == 0 else later_seed(turn), between_turns)


class Rollouts:
    """Stages 1-2: sampling a step's batch and scoring it (the engine, the prompts, the scoring and the
    tokenizer); :meth:`collect` returns the step's :class:`Rollout`.

    Built whole here; what changes afterwards is the prompt sampler's position and, while a batch is drawn,
    :attr:`sampling_speculation`."""

    between_turns: Callable[[], None] | None = None
    """Called between the turns of a multi-turn rollout (asynchronous rollouts let a weight sync in)."""
    partial: SegmentedGeneration | None = None
    """Samples the training rollouts in segments that a weight sync may come between (partial rollouts,
    ``rollout.partial_segment_tokens``); ``None``: each engine call is sampled whole."""

    def __init__(self, engine: RolloutEngine, sampler: PromptSampler, scoring: RolloutScoring, tokenizer,
                 options: RolloutOptions, layout: DataLayout, hooks, timer: StepTimer,
                 engine_metrics: MetricsSink | None = None) -> None:
        self.engine, self.sampler, self.scoring, self.tokenizer = engine, sampler, scoring, tokenizer
        self.options, self.layout, self.hooks, self.timer = options, layout, hooks, timer
        self.engine_metrics = engine_metrics
        """Where the engine reports metrics (its ``EngineContext.metrics``); drained after each batch."""
        self.sample_group = layout.group
        """The process group of :meth:`sample`'s collectives: the data-parallel group, or, when a producer
        thread samples (asynchronous rollouts), a group of its own beside the trainer's."""
        self.sampling_speculation: SpeculationStats | None = None
        """What speculative decoding has done so far in the batch :meth:`draw` is drawing (this rank's engine)."""

    @property
    def rollout(self) -> RolloutConfig:
        return self.options.rollout

    @property
    def turns(self) -> TurnRunner | None:
        return self.options.turns

    @property
    def per_rank(self) -> int:
        """Prompts per data-parallel shard."""
        return self.rollout.prompts_per_step // self.layout.size

    def exclusive_engine(self, version: int):
        """A context that holds the engine for a weight sync to ``version``, or an evaluation after it
        (asynchronous rollouts)."""
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

    def collect(self, step: int) -> Rollout:
        """This rank's :class:`Rollout` of the step (:meth:`sample`), then the engine releases its memory: the
        log-probs and the update that follow get it, and the weight sync takes it back."""
        rollout = self.sample(step)
        self.engine.release_memory()
        return rollout

    def sample(self, step: int) -> Rollout:
        """:meth:`draw` the step's batch, with what the engine reported meanwhile."""
        batch, stats, speculation = self.draw(step)
        report = self.engine_metrics.drain() if self.engine_metrics is not None else {}
        return Rollout(batch, stats, speculation, report)

    def draw(self, step: int) -> tuple[ScoredBatch, dict[str, float], SpeculationStats | None]:
        """Generate, score, and with dynamic sampling (DAPO) drop groups whose rewards are all equal
        and draw more prompts until every rank has its quota; what speculative decoding did meanwhile.

        Rounds are collective (every rank draws while any rank is short), so the prompt samplers of
        all ranks stay in step. A batch still short after ``dynamic_sampling_max_rounds`` is topped up
        with dropped groups, keeping the batch size (and so the loss normalisation) fixed.
        """
        options, per_rank = self.options, self.per_rank
        kept, spare, stats_sum, rounds = [], [], {}, 0
        self.sampling_speculation = SpeculationStats() if options.speculating else None
        while True:
            rounds += 1
            batch, stats = self.draw_round(step, rounds - 1)
            for key, value in stats.items():
                stats_sum[key] = stats_sum.get(key, 0.0) + value
            if not options.dynamic_sampling:
                return batch, stats, self.sampling_speculation
            for group in split_groups(batch):
                (kept if float(group.scores.max() - group.scores.min()) > 0 else spare).append(group)
            short = float(len(kept) < per_rank)
            still_short = float(all_reduce_sum(torch.tensor([short]), self.sample_group)[0]) > 0
            if not still_short or rounds >= options.dynamic_sampling_max_rounds:
                break
        dropped = len(spare)
        groups = (kept + spare)[:per_rank]
        batch = concat_batches(groups, self.tokenizer.pad_token_id)
        batch = replace(batch, group_ids=self.layout.rank * per_rank + torch.arange(len(batch)) // self.rollout.samples_per_prompt)
        stats = {key: value if is_count_stat(key) else value / rounds
                 for key, value in stats_sum.items()}
        stats["dynamic_sampling/rounds"] = float(rounds)
        stats["dynamic_sampling/dropped_groups"] = float(dropped)
        stats["dynamic_sampling/kept_fraction"] = min(len(kept), per_rank) / per_rank
        return batch, stats, self.sampling_speculation

    def draw_round(self, step: int, round_index: int) -> tuple[ScoredBatch, dict[str, float]]:
        """One round: the next prompts' samples (stage 1), then their scores (stage 2), each after its hook."""
        with self.timer.phase("generation"):
            batch, baseline = self.generate(next(self.sampler), step, round_index)
        self.hooks.after_rollout(step=step, batch=batch)
        with self.timer.phase("reward"):
            scores, stats = self.scoring.score(batch, self.sample_group, baseline)
        scored = ScoredBatch.of(batch, scores)
        self.hooks.after_rewards(step=step, batch=scored)
        return scored, stats

    def generate(self, prompts: list, step: int, round_index: int = 0) -> tuple[RolloutBatch, GreedyBaseline | None]:
        """This shard's samples: generated by the replica's leader, the same batch on its other ranks; and
        their scored greedy baselines (``None``: none were asked for)."""
        return from_replica_leader(self.layout, lambda: self._generate(prompts, step, round_index))

    def _generate(self, prompts: list, step: int, round_index: int) -> tuple[RolloutBatch, GreedyBaseline | None]:
        extra_round = (round_index,) if round_index else ()  # round 0 keeps the seed of a run without dynamic sampling
        options = self.options
        params = sampling_params(self.rollout, seed=hash_seed(options.seed, step, self.layout.rank, *extra_round))
        params.ignore_eos = self.rollout.ignore_eos  # training samples only: evaluation stops at EOS
        params.return_routed_experts = options.record_routing
        params.top_logprobs = options.top_logprobs
        engine = self.engine
        if self.turns is not None:
            return self._generate_turns(prompts, params, step, extra_round), None
        completions = (self.partial or engine).generate([p.prompt_ids for p in prompts], params)
        if options.speculating:
            self.sampling_speculation += engine.speculation_stats()
        self.check_versions(completions, step)
        batch = build_rollout_batch(
            [p.prompt_ids for p in prompts],
            completions,
            [p.row for p in prompts],
            group_offset=self.layout.rank * self.per_rank,
            pad_token_id=self.tokenizer.pad_token_id,
            fixed_width=self.rollout.max_new_tokens if self.rollout.true_on_policy else None,
            completion_texts=self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True),
        )
        if options.greedy_baseline:
            return batch, self.greedy_rollout(prompts, completions)
        return batch, None

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
        trajectories = play_turns(self.turns, self.partial or self.engine, prompts, params,
                                  lambda turn: hash_seed(self.options.seed, step, self.layout.rank, *extra_round, 1 << 20 | turn),
                                  self.between_turns)  # fmt: skip
        completions, loss_masks = trajectories_to_completions(trajectories)
        self.check_versions(completions, step)
        return self.trajectory_batch(trajectories, prompts, completions, loss_masks)

    def trajectory_batch(self, trajectories: list[Trajectory], prompts: list, completions, loss_masks) -> RolloutBatch:
        for row, completion in enumerate(completions):
            completion.prompt_index = row  # one prompt row per trajectory: its first observation may differ
        batch = build_rollout_batch(
            [t.context for t in trajectories], completions, [prompts[t.prompt_index].row for t in trajectories],
            group_offset=0, pad_token_id=self.tokenizer.pad_token_id, loss_masks=loss_masks,
            completion_texts=self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True),
        )  # fmt: skip
        versions = torch.full(batch.response_ids.shape, -1, dtype=torch.long)
        for row, t in enumerate(trajectories):
            versions[row, : len(t.weight_versions)] = torch.tensor(t.weight_versions, dtype=torch.long)
        return replace(batch, group_ids=self.layout.rank * self.per_rank + torch.tensor([t.prompt_index for t in trajectories]),
                       token_weight_versions=versions, env=EnvResults.of(trajectories))

    def greedy_rollout(self, prompts: list, completions: list) -> GreedyBaseline:
        """One greedy completion per prompt from the same weights, scored like the samples (with its own
        length), per sample (ReMax's baseline); what went wrong scoring them travels with it
        (:meth:`RolloutScoring.score` raises it, a collective)."""
        greedy = self.engine.generate([p.prompt_ids for p in prompts], sampling_params(self.rollout, seed=0, n=1, greedy=True))
        by_prompt = {c.prompt_index: c for c in greedy}
        ordered = [by_prompt[i] for i in range(len(prompts))]
        texts = self.tokenizer.batch_decode([c.token_ids for c in ordered], skip_special_tokens=True)
        samples = reward_samples([p.row for p in prompts], [len(c.token_ids) for c in ordered], [c.finish_reason for c in ordered])
        result = self.scoring.score_samples(texts, samples)  # timed with the generation
        return GreedyBaseline(texts=[texts[c.prompt_index] for c in completions],
                              scores=torch.tensor([result.scores[c.prompt_index] for c in completions], dtype=torch.float32),
                              error=result.error)


def split_groups(batch: ScoredBatch) -> list[ScoredBatch]:
    """One batch per group (groups are contiguous rows with equal ``group_ids``)."""
    ids = batch.group_ids.tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]] + [len(ids)]
    return [batch.select(slice(a, b)) for a, b in zip(starts, starts[1:])]
