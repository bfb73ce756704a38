"""The training loop: rollout, rewards, targets (log-probs, corrections, advantages), update, weight
sync, metrics, checkpoint.

``train()`` reads top to bottom as one step of RL; each stage lives in :mod:`rlite.stages` and the
run's pieces are built by :func:`rlite.run.build.build_run`. ``run_training(config)`` builds, trains
and tears down.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from rlite.config import RunConfig
from rlite.config.advantage import advantage_choice
from rlite.distributed import init_distributed, shutdown_distributed
from rlite.engines.supervisor import EngineGaveUp
from rlite.hf_models import quiet_transformers_progress
from rlite.metrics import LearningSignalWatch, ProgressBar, StepProfiler, drained, merge_reported
from rlite.perf import PerfMeter
from rlite.plugin_manager import RlitePluginManager, get_plugin_manager, plugin_manager_in_use
from rlite.run.build import Run, build_run, sandbox_hidden_paths
from rlite.run.evaluation import evaluate
from rlite.run.faults import NonFiniteGuard, Preemption, RunStopped, latest_checkpoint_text, stop_on_full_disk
from rlite.run.lifecycle import (
    check_resume_config,
    finish_run,
    log_metrics,
    log_samples,
    save_and_stop_for_preemption,
    save_run_checkpoint,
    step_start_state,
    stop_after_engine_failure,
)
from rlite.run.status import finished_checkpoint
from rlite.sandbox import hidden_from_programs
from rlite.stages.report import step_metrics
from rlite.stages.routing import measure_routing
from rlite.stages.targets import PreparedTargets, prepare_training_targets
from rlite.stages.update import update_critic, update_policy

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def train(run: Run) -> dict[str, Any]:
    cfg, ctx, hook, timer = run.config, run.ctx, run.pm.hook, run.timer
    progress = ProgressBar(cfg.training.steps, run.start_step, cfg.logging.progress_bar and ctx.is_main,
                           plain_every=cfg.logging.log_every)
    signal_watch = LearningSignalWatch(enabled=ctx.is_main and group_relative(run))  # most groups' rewards all equal?
    hook.on_run_start(config=cfg, run_dir=run.run_dir)
    last_metrics: dict[str, float] = {}
    profiler = StepProfiler(cfg.logging.profile, run.start_step, run.run_dir, ctx.rank)
    perf = PerfMeter.for_run(run)  # model FLOPs of the trainer's passes, MFU against the device's peak
    limit = cfg.training.max_nonfinite_in_a_row  # skipped updates in a row, each trained model on its own
    guards = (NonFiniteGuard(limit, run.run_dir), NonFiniteGuard.for_critic(limit, run.run_dir))
    if run.preemption.requested():  # signalled while the run was being built
        raise run.preemption.stop_before_training(run.run_dir, run.start_step)
    if run.start_step == 0 and run.eval_prompts:
        with timer.phase("eval"):
            log_metrics(run, 0, evaluate(run, 0))  # the baseline the run is measured against
    for step in range(run.start_step + 1, cfg.training.steps + 1):
        step_start = time.perf_counter()
        profiler.before_step(step)
        at_start = step_start_state(run)
        run.in_progress = (step, at_start)  # where a run that must stop can save exactly (an engine that died)
        # 1-2. rollout from the engine's current weights, then rewards (a failing reward function
        # scores 0 and is counted); dynamic sampling may draw extra rounds
        batch, reward_stats = run.rollouts.collect(step)
        if step > 1 and run.preemption.requested():  # SIGTERM: the policy is as the previous step left it
            raise save_and_stop_for_preemption(run, step - 1, at_start)

        # 3. pi_old and pi_ref log-probs, KL-in-reward, corrections, advantages (MoE: routing metrics)
        with timer.phase("logprobs"):
            prepared = prepare_targets(run, batch)

        # 4. policy update (mini-batches x micro-batches), then the critic's; a NaN/inf loss or gradient is skipped
        with timer.phase("train"):
            train_metrics, train_logprobs = update_models(run, batch, step, guards)
        hook.after_optimizer_step(step=step, model=run.backend.model, metrics=train_metrics)
        run.in_progress = (step, None)  # the policy has moved: a stop from here saves this step

        # 4b. the speculative draft learns from the same rollouts (its own model: nothing reaches the policy)
        if run.draft is not None:
            with timer.phase("draft"):
                train_metrics.update(run.draft.update(batch))

        # 5. the step's metrics so far: an engine that dies for good at the sync or the evaluation stops the run
        # with this step's checkpoint, which must come with this step's row (run.unlogged_metrics)
        metrics, tokens = step_metrics(
            batch, train_logprobs, reward_stats, measure_mismatch=not prepared.mismatch_measured,
            dp_group=run.layout.group, speculation=run.rollouts.speculation,
            reported=merge_reported([run.rollouts.engine_report, drained(run.backend), drained(run.critic)]),
        )
        metrics.update(prepared.metrics)
        metrics.update(train_metrics)
        run.unlogged_metrics = metrics

        # 6. the engine samples the next batch from exactly these weights
        sync_weights_to_engine(run, step)

        # 7. evaluation, the metrics row, then checkpoint
        if cfg.training.eval_every and step % cfg.training.eval_every == 0 or step == cfg.training.steps:
            with timer.phase("eval"):
                metrics.update(evaluate(run, step))
        metrics.update(timer.step_metrics())
        metrics["perf/tokens_per_s"] = tokens.generated / max(time.perf_counter() - step_start, 1e-9)
        metrics.update(perf.step_metrics(tokens.sequences, metrics, pi_old_recomputed=prepared.mismatch_measured))
        metrics["perf/wall_s"] = time.perf_counter() - run.started  # since this command began building the run
        log_metrics(run, step, metrics)
        run.unlogged_metrics = None
        log_samples(run, step, batch)
        progress.update(step, metrics)
        signal_watch.observe(step, metrics)
        profiler.after_step(step)
        last_metrics = metrics
        # after logging, so a run resumed from this checkpoint has every step's metrics exactly once
        # (the save's time shows up in the next step's time/checkpoint)
        if checkpoint_due(cfg, step):
            with timer.phase("checkpoint"):
                save_run_checkpoint(run, step)
        if run.preemption.requested():  # SIGTERM or Ctrl-C: this step's checkpoint, then exit (status 75)
            raise save_and_stop_for_preemption(run, step)
    progress.close()
    profiler.close()
    return finish_run(run, last_metrics)


def report_already_finished(cfg: RunConfig, checkpoint, is_main: bool) -> dict[str, Any]:
    """The summary (and, on the main rank, the line) of a run whose last step was done before: nothing ran."""
    from pathlib import Path

    run_dir = Path(cfg.logging.run_dir)
    exported = run_dir / "hf_model"
    summary: dict[str, Any] = {"steps": cfg.training.steps, "run_dir": str(run_dir), "already_finished": True,
                               "checkpoint": str(checkpoint)}
    if exported.is_dir():
        summary["exported_model"] = str(exported.resolve())
    if is_main:
        print(f"rlite: {run_dir} already finished its {cfg.training.steps} steps ({checkpoint.name}); nothing ran. "
              + (f"The model: {summary['exported_model']} (talk to it: rlite chat {run_dir}). " if exported.is_dir() else "")
              + "More steps: training.steps=N (N larger); a fresh run: checkpoint.resume=never or another logging.run_dir",
              flush=True)
    return summary


def group_relative(run: Run) -> bool:
    """The advantage estimator's baseline comes from the other samples of a prompt (registered with
    ``needs_group``): a group whose rewards are all equal then gets zero advantages. A critic's or a
    greedy baseline's advantages do not vanish that way, so only these runs are watched for it."""
    return advantage_choice(run.config.algorithm, run.pm.registries).group_baseline


def prepare_targets(run: Run, batch) -> PreparedTargets:
    """Stage 3: ``batch.targets`` filled (:func:`prepare_training_targets`); for an MoE policy whose routing
    is measured, its agreement with and without replay added to the metrics."""
    prepared = prepare_training_targets(
        batch, run.targets, policy=run.backend, reference=run.reference, critic=run.critic,
        forward=run.forward, loss=run.loss, kl_controller=run.kl_controller, layout=run.layout,
    )
    if run.routing is not None and run.routing.metrics:
        prepared.metrics.update(measure_routing(
            run.backend, batch, run.forward, run.routing, minibatches=run.config.algorithm.minibatches_per_step,
            layout=run.layout,
        ))
    return prepared


def update_models(
    run: Run, batch, step: int, guards: tuple[NonFiniteGuard, NonFiniteGuard]
) -> tuple[dict[str, float], torch.Tensor]:
    """Stage 4: the policy's update, then the critic's (one loop, :func:`rlite.stages.update.train_minibatches`);
    their metrics and the policy's first-pass log-probs. ``guards`` (the policy's, the critic's) stop the
    run after too many skipped updates in a row."""
    cfg, hook = run.config, run.pm.hook
    policy_guard, critic_guard = guards
    train_metrics, train_logprobs = update_policy(
        run.backend,
        batch,
        run.forward,
        run.loss,
        minibatches=cfg.algorithm.minibatches_per_step,
        epochs=cfg.algorithm.epochs_per_step,
        dp_size=run.layout.size,
        dp_group=run.layout.group,
        before_step=functools.partial(
            hook.before_optimizer_step, step=step, model=run.backend.model, optimizer=run.backend.optimizer
        ),
        timer=run.timer,
        outcomes=(outcomes := []),
    )
    policy_guard.record(step, outcomes)
    if run.critic is not None:
        train_metrics.update(update_critic(
            run.critic, batch, run.forward, value_clip=cfg.algorithm.critic.value_clip, agg_mode=run.loss.agg_mode,
            horizon=run.loss.horizon, minibatches=cfg.algorithm.minibatches_per_step, dp_size=run.layout.size,
            dp_group=run.layout.group, outcomes=(critic_outcomes := []),
        ))
        critic_guard.record(step, critic_outcomes)
    return train_metrics, train_logprobs


def sync_weights_to_engine(run: Run, step: int) -> None:
    """Stage 6: the policy's weights to the engine, as version ``step`` (asynchronous rollouts: between two
    generations, never in the middle of one)."""
    with run.timer.phase("weight_sync"), run.rollouts.exclusive_engine(step):
        run.sync_weights(version=step)
    run.rollouts.weights_synced(step)
    run.pm.hook.after_weight_sync(step=step, weight_version=step, engine=run.engine)


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    """A periodic checkpoint (``checkpoint.every``), or the final one (``checkpoint.save_final``)."""
    return bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0
                or step == cfg.training.steps and cfg.checkpoint.save_final)


def close_loggers_after_failure(run: Run) -> None:
    """Close the loggers of a run that stopped early (a normal end closes them in ``finish_run``): what
    they buffer reaches their files and W&B ends its run, also for a rank that leaves through
    ``os._exit`` (:func:`rlite.distributed.leave_rank_process`), where no interpreter exit would."""
    for logger in run.loggers:
        try:
            logger.close()
        except Exception as exc:  # noqa: BLE001  (the failure that stopped the run is the one to report)
            log.warning("closing the %s logger after the run stopped failed: %s", type(logger).__name__, exc)


def run_training(cfg: RunConfig, pm: RlitePluginManager | None = None,
                 preemption: Preemption | None = None) -> dict[str, Any]:
    """Build everything from the config (with the plugins of ``pm``, by default the process-wide
    manager), train, and tear down.

    ``preemption``: handlers the caller installed already (``rlite train`` does, before it reads the
    config, so that a SIGTERM during start-up is caught too); the caller uninstalls them. Without it
    the handlers are installed here for the run's duration.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ctx = init_distributed()
    finished = False
    owned = preemption is None
    if owned:
        preemption = Preemption(cfg.checkpoint.preempt_timeout_s)
        preemption.install()  # from here a SIGTERM waits for the next step boundary
    else:
        preemption.set_timeout(cfg.checkpoint.preempt_timeout_s)
    try:
        done = finished_checkpoint(cfg)
        if done is not None:  # re-running a finished run: say so, rather than a summary of steps that did not run
            check_resume_config(cfg, done)  # another model or algorithm is still refused, not called finished
            finished = True
            return report_already_finished(cfg, done, ctx.is_main)
        # the write paths name themselves when a full disk stops them; anything else written (config.yaml,
        # the loggers' first files, a profile, offloaded moments) stops as cleanly, naming the run folder;
        # transformers' own load/save bars would break rlite's progress line
        # (every program a reward runs in the sandbox is kept out of the run's folder, data and offload folder)
        with quiet_transformers_progress(), hidden_from_programs(sandbox_hidden_paths(cfg)):
            try:
                with stop_on_full_disk("the run's files", cfg.logging.run_dir, cfg.logging.run_dir), \
                        plugin_manager_in_use(pm if pm is not None else get_plugin_manager()) as run_pm:
                    run = build_run(cfg, run_pm)
            except EngineGaveUp as failure:  # it kept dying while starting or at the first sync: nothing ran
                raise RunStopped(f"{failure}. No step ran in this run; {latest_checkpoint_text(cfg.logging.run_dir)}") from None
            run.preemption = preemption
            try:
                with stop_on_full_disk("the run's files", run.run_dir, run.run_dir):
                    summary = train(run)
            except EngineGaveUp as failure:  # dead past its restarts: a checkpoint and a message, no traceback
                try:
                    stopped = stop_after_engine_failure(run, failure)  # logs the step's row first: loggers still open
                finally:
                    close_loggers_after_failure(run)
                raise stopped from None
            except BaseException:
                close_loggers_after_failure(run)
                raise
            finally:
                run.rollouts.close()
                run.engine.shutdown()
                run.backend.close()
                run.rollouts.scoring.rewards.close()
        finished = True
        return summary
    finally:
        if owned:
            preemption.uninstall()
        shutdown_distributed(ctx, finished=finished)
