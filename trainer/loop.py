"""The training loop: rollout, rewards, log-probs, advantages, corrections, update, weight sync.

``train()`` reads top to bottom as one step of RL; every piece of complexity lives in a function
named for what it does. ``run_training(config)`` builds the pieces and calls it.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlite.algorithms import AdvantageInput
from rlite.config import ConfigError, RunConfig, config_to_yaml
from rlite.distributed import (
    DistContext,
    all_gather_objects,
    all_reduce_sum,
    init_distributed,
    shutdown_distributed,
)
from rlite.engines.base import SamplingParams
from rlite.metrics import ProgressBar, StepProfiler, StepTimer, plot_run, print_summary, trim_metrics_file
from rlite.plugin_manager import get_plugin_manager, resolve_choice
from rlite.plugins.kl import AdaptiveKLController, kl_reward_penalty
from rlite.rollout import RolloutBatch, build_rollout_batch, concat_batches, pad_to_width
from rlite.update import ForwardSpec, LossSpec, score_logprobs, update_policy

log = logging.getLogger("rlite")


@dataclass
class Run:
    """Everything ``train()`` works with, built once by :func:`build_run`."""

    config: RunConfig
    ctx: DistContext
    pm: Any
    run_dir: Path
    tokenizer: Any
    train_prompts: Any
    eval_prompts: Any
    sampler: Any
    backend: Any
    reference: Any
    engine: Any
    rewards: Any
    advantage: tuple[Any, Any]
    loss: LossSpec
    forward: ForwardSpec
    corrections: list
    quantizer: tuple[Any, Any] | None = None
    kl_controller: Any = None
    critic: Any = None
    loggers: list = field(default_factory=list)
    timer: StepTimer = field(default_factory=StepTimer)
    start_step: int = 0


# --------------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------------


def train(run: Run) -> dict[str, Any]:
    cfg, ctx, pm, timer = run.config, run.ctx, run.pm, run.timer
    progress = ProgressBar(cfg.training.steps, run.start_step, cfg.logging.progress_bar and ctx.is_main)
    pm.hook.on_run_start(config=cfg, run_dir=run.run_dir)
    last_metrics: dict[str, float] = {}
    profiler = StepProfiler(cfg.logging.profile, run.start_step, run.run_dir, ctx.rank)
    if run.start_step == 0 and run.eval_prompts:
        with timer.phase("eval"):
            log_metrics(run, 0, evaluate(run, 0))  # the baseline the run is measured against
    for step in range(run.start_step + 1, cfg.training.steps + 1):
        step_start = time.perf_counter()
        profiler.before_step(step)
        # 1-2. rollout from the engine's current weights, then rewards (a failing reward function
        # scores 0 and is counted); dynamic sampling may draw extra rounds
        batch, reward_stats = collect_rollouts(run, step)

        # 3. pi_old and pi_ref log-probs, KL-in-reward, corrections, advantages
        with timer.phase("logprobs"):
            prepare_training_targets(run, batch)

        # 4. policy update (mini-batches x micro-batches, global loss normalisation)
        with timer.phase("train"):
            train_metrics, train_logprobs = update_policy(
                run.backend,
                batch,
                run.forward,
                run.loss,
                minibatches=cfg.algorithm.minibatches_per_step,
                epochs=cfg.algorithm.epochs_per_step,
                dp_size=ctx.world_size,
                before_step=functools.partial(
                    pm.hook.before_optimizer_step, step=step, model=run.backend.model, optimizer=run.backend.optimizer
                ),
                timer=timer,
            )
            if run.critic is not None:
                train_metrics.update(update_critic(run, batch))
        pm.hook.after_optimizer_step(step=step, model=run.backend.model, metrics=train_metrics)

        # 5. the engine samples the next batch from exactly these weights
        with timer.phase("weight_sync"):
            sync_weights_to_engine(run, version=step)
        pm.hook.after_weight_sync(step=step, weight_version=step, engine=run.engine)

        # 6. metrics, evaluation, then checkpoint
        metrics = step_metrics(run, batch, train_logprobs, reward_stats)
        metrics.update(train_metrics)
        if cfg.training.eval_every and step % cfg.training.eval_every == 0 or step == cfg.training.steps:
            with timer.phase("eval"):
                metrics.update(evaluate(run, step))
        metrics.update(timer.step_metrics())
        generated = float(all_reduce_sum(batch.response_mask.sum().reshape(1))[0])
        metrics["perf/tokens_per_s"] = generated / max(time.perf_counter() - step_start, 1e-9)
        log_metrics(run, step, metrics)
        progress.update(step, metrics)
        profiler.after_step(step)
        last_metrics = metrics
        # after logging, so a run resumed from this checkpoint has every step's metrics exactly once
        # (the save's time shows up in the next step's time/checkpoint)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 or (
            step == cfg.training.steps and cfg.checkpoint.save_final
        ):
            with timer.phase("checkpoint"):
                save_run_checkpoint(run, step)
    progress.close()
    profiler.close()
    return finish_run(run, last_metrics)


# --------------------------------------------------------------------------------------------------
# step pieces
# --------------------------------------------------------------------------------------------------


def sampling_params(cfg: RunConfig, *, seed: int, n: int | None = None, greedy: bool = False) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        n=r.samples_per_prompt if n is None else n,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        greedy=greedy,
        seed=seed,
    )


def collect_rollouts(run: Run, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's batch of the step: generate, score, and with dynamic sampling (DAPO) drop groups
    whose rewards are all equal and draw more prompts until every rank has its quota of groups.

    Rounds are collective (every rank draws while any rank is short), so the prompt samplers of all
    ranks stay in step. A batch still short after ``dynamic_sampling_max_rounds`` is topped up with
    dropped groups, keeping the batch size (and so the loss normalisation) fixed.
    """
    cfg, pm, timer = run.config, run.pm, run.timer
    per_rank = cfg.rollout.prompts_per_step // run.ctx.world_size
    kept, spare, stats_sum, rounds = [], [], {}, 0
    while True:
        rounds += 1
        with timer.phase("generation"):
            batch = generate_rollouts(run, next(run.sampler), step, rounds - 1)
        pm.hook.after_rollout(step=step, batch=batch)
        with timer.phase("reward"):
            stats = score_batch(run, batch)
        pm.hook.after_rewards(step=step, batch=batch)
        for key, value in stats.items():
            stats_sum[key] = stats_sum.get(key, 0.0) + value
        if not cfg.algorithm.dynamic_sampling:
            return batch, stats
        for group in split_groups(batch):
            (kept if float(group.scores.max() - group.scores.min()) > 0 else spare).append(group)
        short = float(len(kept) < per_rank)
        still_short = float(all_reduce_sum(torch.tensor([short]))[0]) > 0
        if not still_short or rounds >= cfg.algorithm.dynamic_sampling_max_rounds:
            break
    dropped = len(spare)
    groups = (kept + spare)[:per_rank]
    batch = concat_batches(groups, run.tokenizer.pad_token_id)
    samples_per_group = cfg.rollout.samples_per_prompt
    batch.group_ids = run.ctx.rank * per_rank + torch.arange(len(batch)) // samples_per_group
    stats = {key: value / rounds for key, value in stats_sum.items()}
    stats["dynamic_sampling/rounds"] = float(rounds)
    stats["dynamic_sampling/dropped_groups"] = float(dropped)
    stats["dynamic_sampling/kept_fraction"] = min(len(kept), per_rank) / per_rank
    return batch, stats


def split_groups(batch: RolloutBatch) -> list[RolloutBatch]:
    """One batch per group (groups are contiguous rows with equal ``group_ids``)."""
    ids = batch.group_ids.tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]] + [len(ids)]
    return [batch.select(slice(a, b)) for a, b in zip(starts, starts[1:])]


def generate_rollouts(run: Run, prompts: list, step: int, round_index: int = 0) -> RolloutBatch:
    cfg = run.config
    extra_round = (round_index,) if round_index else ()  # round 0 keeps the seed of a run without dynamic sampling
    params = sampling_params(cfg, seed=hash_seed(cfg.training.seed, step, run.ctx.rank, *extra_round))
    run.engine.resume_memory()
    completions = run.engine.generate([p.prompt_ids for p in prompts], params)
    stale = {c.weight_version for c in completions} - {run.engine.weight_version}
    if stale or run.engine.weight_version != step - 1:
        raise RuntimeError(
            f"step {step}: the engine sampled with weight version(s) {sorted(stale) or run.engine.weight_version}, "
            f"expected {step - 1}: a weight sync was lost"
        )
    per_rank = cfg.rollout.prompts_per_step // run.ctx.world_size
    batch = build_rollout_batch(
        [p.prompt_ids for p in prompts],
        completions,
        [p.row for p in prompts],
        group_offset=run.ctx.rank * per_rank,
        pad_token_id=run.tokenizer.pad_token_id,
        fixed_width=cfg.rollout.max_new_tokens if cfg.rollout.true_on_policy else None,
    )
    batch.completion_texts = run.tokenizer.batch_decode(
        [c.token_ids for c in completions], skip_special_tokens=True
    )
    return batch


def score_batch(run: Run, batch: RolloutBatch) -> dict[str, float]:
    # each sample gets its own copy of the data row plus what length-aware rewards need
    batch.samples = [
        dict(sample, response_length=int(length), finish_reason=reason)
        for sample, length, reason in zip(batch.samples, batch.response_lengths.tolist(), batch.finish_reasons)
    ]
    scores, stats = run.rewards.score(batch.completion_texts, batch.samples)
    batch.scores = torch.tensor(scores, dtype=torch.float32)
    return stats


def prepare_training_targets(run: Run, batch: RolloutBatch) -> None:
    """Fill ``batch.extras``: old/ref log-probs, loss mask, IS weights, advantages."""
    cfg = run.config
    algo = cfg.algorithm
    one_step_on_policy = algo.minibatches_per_step == 1 and algo.epochs_per_step == 1
    need_old = not one_step_on_policy or bool(run.corrections) or algo.kl.in_reward
    if algo.old_logprob_mode == "bypass":
        batch.extras["old_logprobs"] = batch.rollout_logprobs.clone()
    elif need_old:
        batch.extras["old_logprobs"] = score_logprobs(run.backend.model, batch, run.forward, algo.minibatches_per_step)
    if run.reference is not None:
        batch.extras["ref_logprobs"] = score_logprobs(run.reference, batch, run.forward, algo.minibatches_per_step)
    token_rewards = None
    if algo.kl.in_reward and run.reference is not None:
        kl = run.loss.kl_fn(batch.extras["old_logprobs"], batch.extras["ref_logprobs"]).detach()
        token_rewards = kl_reward_penalty(kl, run.kl_controller.value, batch.response_mask)
        batch.info["actor/reward_kl_penalty_coeff"] = run.kl_controller.value
        batch.info["actor/reward_kl_penalty"] = update_kl_controller(run, kl, batch.response_mask)
    batch.extras["loss_mask"] = batch.response_mask.clone()
    if algo.mask_truncated:
        truncated = torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.bool)
        batch.extras["loss_mask"][truncated] = 0.0
    if run.corrections and not run.loss.loss_time_corrections:
        from rlite.mismatch import compose_corrections

        weights, mask, corr_metrics = compose_corrections(
            run.corrections, batch.extras["old_logprobs"], batch.rollout_logprobs, batch.extras["loss_mask"]
        )
        batch.extras["loss_mask"] = mask
        if weights is not None:
            batch.extras["is_weights"] = weights
        batch.info.update(corr_metrics)
    if run.critic is not None:
        batch.extras["old_values"] = run.critic.values(
            batch, cfg.training.micro_batch_size, cfg.rollout.true_on_policy, algo.minibatches_per_step
        )
    batch.extras["advantages"], batch.extras["returns"] = compute_advantages(run, batch, token_rewards)


def update_kl_controller(run: Run, kl: torch.Tensor, mask: torch.Tensor) -> float:
    """Feed this step's KL (global mean over sequences of their token mean) to the controller;
    the coefficient it returns applies from the next step on. Returns the KL."""
    counts = mask.sum(-1)
    nonempty = counts > 0
    per_sequence = (kl * mask).sum(-1)[nonempty] / counts[nonempty]
    kl_sum, n = all_reduce_sum(torch.stack([per_sequence.sum(), nonempty.sum().to(kl.dtype)])).tolist()
    mean_kl = kl_sum / max(n, 1.0)
    run.kl_controller.update(mean_kl, int(n))
    return mean_kl


def update_critic(run: Run, batch: RolloutBatch) -> dict[str, float]:
    cfg = run.config
    return run.critic.update(
        batch,
        micro_batch_size=cfg.training.micro_batch_size,
        minibatches=cfg.algorithm.minibatches_per_step,
        agg_mode=cfg.algorithm.loss_agg_mode,
        horizon=run.loss.horizon,
        dp_size=run.ctx.world_size,
        exact_layout=cfg.rollout.true_on_policy,
    )


def compute_advantages(
    run: Run, batch: RolloutBatch, token_rewards: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator on the *global* batch (gathered from all ranks), keep this rank's rows.

    Estimators that normalise over the batch (GRPO batch std, REINFORCE++ whitening) therefore give
    the same advantages at every world size.
    """
    local_width = batch.response_mask.shape[1]
    values = batch.extras.get("old_values")
    parts = all_gather_objects((batch.scores, batch.group_ids, batch.response_mask, token_rewards, values))
    width = max(p[2].shape[1] for p in parts)
    estimator, estimator_cfg = run.advantage
    gathered = AdvantageInput(
        scores=torch.cat([p[0] for p in parts]),
        group_ids=torch.cat([p[1] for p in parts]),
        response_mask=torch.cat([pad_to_width(p[2], width) for p in parts]),
        token_rewards=None
        if token_rewards is None
        else torch.cat([pad_to_width(p[3], width) for p in parts]),
        values=None if values is None else torch.cat([pad_to_width(p[4], width) for p in parts]),
    )
    advantages, returns = estimator(gathered, estimator_cfg)
    start = sum(len(p[0]) for p in parts[: run.ctx.rank])
    rows = slice(start, start + len(batch))
    return advantages[rows, :local_width].float(), returns[rows, :local_width].float()


def sync_weights_to_engine(run: Run, version: int) -> None:
    """Stream the full (LoRA-merged) weights into the engine; the engine must report ``version``."""
    from rlite.engines.weight_sync import iter_full_tensors

    run.engine.release_memory()
    if run.config.rollout.lora_sync == "adapter":  # the engine keeps its base and serves the adapter
        from rlite.engines.weight_sync import iter_lora_adapter_tensors, lora_adapter_config

        lm = run.backend.model.lm
        run.engine.update_lora_adapter(iter_lora_adapter_tensors(lm), lora_adapter_config(lm), version)
        return
    # an in-process engine that shares the trainer's weights gets the parameters' own storage
    views = getattr(run.engine, "share_weights", False) and run.quantizer is None and not run.backend.lora
    named = iter_full_tensors(run.backend.model.lm, lora_merge=run.backend.lora, views=views)
    if run.quantizer is not None:  # the engine samples with quantized weights; the trainer keeps full precision
        quantize, quant_cfg = run.quantizer
        named = ((name, quantize(name, tensor, quant_cfg)) for name, tensor in named)
    run.engine.update_weights(named, version)
    if run.engine.weight_version != version:
        raise RuntimeError(f"weight sync: engine reports version {run.engine.weight_version}, expected {version}")


def step_metrics(run: Run, batch: RolloutBatch, train_logprobs: torch.Tensor, reward_stats) -> dict[str, float]:
    from rlite.mismatch import mismatch_metrics

    mask = batch.response_mask
    old = batch.extras.get("old_logprobs", train_logprobs)
    local = {
        "reward/mean": batch.scores.sum().item(),
        "reward/accuracy": (batch.scores > 0).float().sum().item(),
        "response/length": mask.sum().item(),
        "response/truncated": float(sum(r == "length" for r in batch.finish_reasons)),
        "count": float(len(batch)),
    }
    totals = dict(zip(local, all_reduce_sum(torch.tensor(list(local.values()))).tolist()))
    count = totals.pop("count")
    metrics = {k: v / count for k, v in totals.items()}
    scores = torch.cat(all_gather_objects(batch.scores))
    metrics["reward/std"] = scores.std().item() if len(scores) > 1 else 0.0
    adv = batch.extras["advantages"]
    metrics["advantage/mean"] = (adv * mask).sum().item() / max(mask.sum().item(), 1)
    metrics["advantage/zero_variance_groups"] = zero_variance_fraction(batch)
    metrics.update(mismatch_metrics(old, batch.rollout_logprobs, mask))
    metrics.update(batch.info)
    metrics.update({k: float(v) for k, v in reward_stats.items()})
    return metrics


def zero_variance_fraction(batch: RolloutBatch) -> float:
    groups = {}
    for gid, score in zip(batch.group_ids.tolist(), batch.scores.tolist()):
        groups.setdefault(gid, []).append(score)
    flat = sum(1 for s in groups.values() if max(s) == min(s))
    totals = all_reduce_sum(torch.tensor([float(flat), float(len(groups))]))
    return float(totals[0] / totals[1])


@torch.no_grad()
def evaluate(run: Run, step: int) -> dict[str, float]:
    """Greedy and sampled accuracy on this rank's share of the held-out prompts."""
    if not run.eval_prompts:
        return {}
    cfg, ctx = run.config, run.ctx
    items = list(run.eval_prompts)[: cfg.training.eval_max_prompts][ctx.rank :: ctx.world_size]
    out = {}
    for mode, greedy in (("greedy", True), ("sampled", False)):
        params = sampling_params(cfg, seed=hash_seed(cfg.training.seed, step, ctx.rank, 7), n=1, greedy=greedy)
        completions = run.engine.generate([p.prompt_ids for p in items], params) if items else []
        texts = run.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        scores, _ = run.rewards.score(texts, [p.row for p in items]) if items else ([], {})
        totals = all_reduce_sum(torch.tensor([float(sum(s > 0 for s in scores)), float(sum(scores)), float(len(scores))]))
        n = max(float(totals[2]), 1.0)
        out[f"eval/{mode}_accuracy"] = float(totals[0]) / n
        out[f"eval/{mode}_reward"] = float(totals[1]) / n
    return out


def log_metrics(run: Run, step: int, metrics: dict[str, float]) -> None:
    if run.ctx.is_main:
        for logger in run.loggers:
            logger.log(step, metrics)
        run.pm.hook.on_metrics(step=step, metrics=metrics)


def hash_seed(*parts: int) -> int:
    """A deterministic 31-bit seed from integers (same on every run and resume)."""
    value = 0x9E3779B1
    for part in parts:
        value = (value * 1000003) ^ (int(part) & 0xFFFFFFFF)
        value &= 0xFFFFFFFFFFFF
    return value % (2**31 - 1)


# --------------------------------------------------------------------------------------------------
# checkpoint and end of run
# --------------------------------------------------------------------------------------------------


def trainer_state(run: Run) -> dict[str, Any]:
    return {
        "scheduler": run.backend.scheduler.state_dict(),
        "sampler": run.sampler.state_dict(),
        "kl_controller": run.kl_controller.state_dict(),
    }


def extra_models(run: Run) -> dict[str, tuple[Any, Any]]:
    return {} if run.critic is None else {"critic": (run.critic.model, run.critic.optimizer)}


def save_run_checkpoint(run: Run, step: int) -> Path:
    from rlite.checkpoint import save_checkpoint

    path = save_checkpoint(
        run.run_dir,
        step,
        run.backend.model,
        run.backend.optimizer,
        trainer_state(run),
        rank=run.ctx.rank,
        keep_last=run.config.checkpoint.keep_last,
        extra_models=extra_models(run),
    )
    release = getattr(run.backend.optimizer, "release_pages", None)
    if release is not None:  # the save read the offloaded moments into memory: give those pages back
        release()
    run.pm.hook.on_checkpoint_save(step=step, path=path)
    return path


def maybe_resume(run: Run) -> int:
    from rlite.checkpoint import find_resume_checkpoint, load_checkpoint

    path = find_resume_checkpoint(run.run_dir, run.config.checkpoint.resume)
    if path is None:
        return 0
    state = load_checkpoint(
        path, run.backend.model, run.backend.optimizer, rank=run.ctx.rank, extra_models=extra_models(run)
    )
    run.backend.scheduler.load_state_dict(state["scheduler"])
    run.sampler.load_state_dict(state["sampler"])
    run.kl_controller.load_state_dict(state["kl_controller"])
    step = int(state["step"])
    if run.ctx.is_main:
        log.info("resumed from %s (step %d)", path, step)
    run.pm.hook.on_checkpoint_load(step=step, path=path)
    return step


def finish_run(run: Run, last: dict[str, float]) -> dict[str, Any]:
    """Export, plot, print the summary and the time breakdown; the summary is read from the metrics
    file, so a resumed (or already finished) run reports its whole history."""
    cfg = run.config
    if cfg.checkpoint.export_hf:
        from rlite.export import export_hf

        export_hf(run.backend, run.tokenizer, run.run_dir / "hf_model", is_main=run.ctx.is_main)
    summary: dict[str, Any] = {"steps": cfg.training.steps, "run_dir": str(run.run_dir)}
    if run.ctx.is_main:
        for logger in run.loggers:
            logger.close()
        summary.update(summarize_metrics(run.run_dir / "metrics.jsonl", last))
        if cfg.logging.plot and (run.run_dir / "metrics.jsonl").is_file():
            summary["plot"] = str(plot_run(run.run_dir / "metrics.jsonl", run.run_dir / "plot.png"))
        print_summary(summary, dict(run.timer.total))
    summary["time_breakdown"] = dict(run.timer.total)
    run.pm.hook.on_run_end(config=cfg, summary=summary)
    return summary


def summarize_metrics(metrics_file: Path, last: dict[str, float]) -> dict[str, float]:
    """Final reward and held-out accuracies, with the accuracy at the run's first evaluation."""
    from rlite.metrics import read_metrics

    rows = read_metrics(metrics_file) if metrics_file.is_file() else []
    trained = [r for r in rows if "reward/mean" in r] or [last]
    evals = [r for r in rows if "eval/greedy_accuracy" in r]
    out = {"final_reward": trained[-1].get("reward/mean", math.nan)}
    for mode in ("greedy", "sampled"):
        key = f"eval/{mode}_accuracy"
        if evals:
            first, final = evals[0][key], evals[-1][key]
            out[f"eval_{mode}_accuracy_first (step {evals[0]['step']})"] = first
            out[f"eval_{mode}_accuracy_final (step {evals[-1]['step']})"] = final
            out[f"eval_{mode}_accuracy_gain"] = final - first
    return out


# --------------------------------------------------------------------------------------------------
# building a run
# --------------------------------------------------------------------------------------------------


def build_run(cfg: RunConfig) -> Run:
    from rlite.data import PromptSampler, load_prompt_splits
    from rlite.mismatch import build_corrections, needs_current_logprobs
    from rlite.rewards import build_reward_runner

    ctx = init_distributed()
    if cfg.training.num_threads is not None:
        torch.set_num_threads(cfg.training.num_threads)
    if cfg.training.keep_freed_memory:
        from rlite.allocator import keep_freed_memory

        keep_freed_memory()
    torch.manual_seed(cfg.training.seed)
    pm = get_plugin_manager()
    run_dir = Path(cfg.logging.run_dir)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    tokenizer = load_tokenizer(cfg)
    try:
        train_prompts, eval_prompts = load_prompt_splits(cfg.data, tokenizer)
    except (FileNotFoundError, ValueError, KeyError) as exc:  # bad data files: the messages name the key
        raise ConfigError(str(exc).strip("'\"")) from exc
    sampler = PromptSampler(
        train_prompts.items, cfg.rollout.prompts_per_step, ctx.rank, ctx.world_size, cfg.data.seed, cfg.data.shuffle
    )
    algo = cfg.algorithm
    total_opt_steps = cfg.training.steps * algo.minibatches_per_step * algo.epochs_per_step
    make_backend, backend_cfg = resolve_choice(pm.registry("training_backend"), cfg.parallelism.backend)
    backend = make_backend(cfg, backend_cfg, ctx.device, total_opt_steps)
    reference = None
    if algo.kl.coef != 0.0:
        from rlite.actor import build_policy

        reference = build_policy(cfg.model, cfg.parallelism, ctx.device, trainable=False)
    critic = None
    if algo.critic.enabled:
        from rlite.critic import Critic

        critic = Critic.build(cfg.model, cfg.parallelism, algo.critic, ctx.device)
    policy_loss, policy_cfg = resolve_choice(pm.registry("policy_loss"), algo.policy_loss)
    corrections = build_corrections(algo.corrections, pm.registry("mismatch_correction"))
    kl_fn = pm.registry("kl_estimator").get(algo.kl.estimator).implementation
    run = Run(
        config=cfg,
        ctx=ctx,
        pm=pm,
        run_dir=run_dir,
        tokenizer=tokenizer,
        train_prompts=train_prompts,
        eval_prompts=eval_prompts,
        sampler=sampler,
        backend=backend,
        reference=reference,
        engine=None,
        rewards=build_reward_runner(cfg.rewards, pm.registry("reward_function"), timeout_s=cfg.reward_timeout_s),
        advantage=resolve_choice(pm.registry("advantage_estimator"), algo.advantage),
        loss=LossSpec(
            policy_loss=policy_loss,
            policy_cfg=policy_cfg,
            agg_mode=algo.loss_agg_mode,
            horizon=float(algo.loss_agg_horizon or cfg.rollout.max_new_tokens),
            kl_fn=kl_fn,
            kl_coef=0.0 if algo.kl.in_reward else algo.kl.coef,
            entropy_coef=algo.entropy_coef,
            loss_time_corrections=corrections if needs_current_logprobs(corrections) else [],
        ),
        forward=ForwardSpec(
            micro_batch_size=cfg.training.micro_batch_size,
            temperature=cfg.rollout.temperature,
            chunk_size=cfg.training.logprob_chunk_size,
            exact_layout=cfg.rollout.true_on_policy,
            use_liger=check_liger(cfg),
            entropy_grad=algo.entropy_coef != 0.0,
            recompute_above_bytes=cfg.training.logprob_recompute_mb * 2**20,
            # HF activation checkpointing turns the KV cache off, so sharing needs it off
            share_prompts=cfg.training.share_prompt_prefix and not cfg.parallelism.activation_checkpointing,
        ),
        corrections=corrections,
        critic=critic,
        quantizer=None
        if cfg.rollout.quantization.name == "none"
        else resolve_choice(pm.registry("rollout_quantizer"), cfg.rollout.quantization),
    )
    run.kl_controller = build_kl_controller(cfg)
    run.start_step = maybe_resume(run)
    if ctx.is_main:
        trim_metrics_file(run_dir / "metrics.jsonl", run.start_step if run.start_step else None)
        run.loggers = build_loggers(run)
    # the engine last: a failure above leaves no engine process behind
    make_engine, engine_cfg = resolve_choice(pm.registry("rollout_engine"), cfg.rollout.engine)
    run.engine = make_engine(cfg.model, tokenizer, cfg.rollout, engine_cfg)
    if cfg.rollout.lora_sync == "adapter" and not getattr(run.engine, "takes_lora_adapters", False):
        run.engine.shutdown()
        raise ConfigError(
            f"rollout.lora_sync=adapter: the {cfg.rollout.engine.name!r} engine cannot serve adapters; "
            "use rollout.lora_sync=merged or an engine that can (sglang)"
        )
    try:
        sync_weights_to_engine(run, version=run.start_step)
    except BaseException:
        run.engine.shutdown()
        raise
    return run


class FixedKLController:
    """A constant KL-in-reward coefficient (same interface as the adaptive controller)."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def build_kl_controller(cfg: RunConfig):
    kl = cfg.algorithm.kl
    if kl.adaptive_target is not None:
        return AdaptiveKLController(kl.coef, kl.adaptive_target, kl.adaptive_horizon)
    return FixedKLController(kl.coef)


def check_liger(cfg: RunConfig) -> bool:
    """Validate ``training.liger_fused_logprobs`` against this machine (its kernels need CUDA)."""
    if not cfg.training.liger_fused_logprobs:
        return False
    if not torch.cuda.is_available():
        raise ConfigError(
            "training.liger_fused_logprobs needs CUDA: liger-kernel's Triton kernels do not run on CPU "
            "(the default chunked path keeps memory bounded there)"
        )
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        raise ConfigError("training.liger_fused_logprobs: liger-kernel is not installed; pip install 'rlite[liger]'") from None
    if cfg.algorithm.entropy_coef != 0.0:
        raise ConfigError(
            "training.liger_fused_logprobs computes no entropy gradient; set algorithm.entropy_coef=0 or turn liger off"
        )
    return True


def load_tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    source = cfg.model.tokenizer or cfg.model.path
    kwargs = {"gguf_file": cfg.model.gguf_file} if cfg.model.gguf_file and not cfg.model.tokenizer else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
        raise ConfigError(f"{key}: cannot load a tokenizer from {source!r} ({exc})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_loggers(run: Run) -> list:
    loggers = []
    registry = run.pm.registry("logger")
    for choice in run.config.logging.loggers:
        factory, logger_cfg = resolve_choice(registry, choice)
        logger = factory(run.run_dir, run.config, logger_cfg)
        if logger is not None:
            loggers.append(logger)
    return loggers


def run_training(cfg: RunConfig) -> dict[str, Any]:
    """Build everything from the config, train, and tear down."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ctx = init_distributed()
    finished = False
    try:
        run = build_run(cfg)
        try:
            summary = train(run)
        finally:
            run.engine.shutdown()
            close = getattr(run.backend.optimizer, "close", None)  # e.g. deletes offloaded moment files
            if close is not None:
                close()
        finished = True
        return summary
    finally:
        shutdown_distributed(ctx, finished=finished)
