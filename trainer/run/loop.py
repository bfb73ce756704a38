"""The training loop: rollout, rewards, targets (log-probs, corrections, advantages), update, weight
sync, metrics, checkpoint.

``train()`` reads top to bottom as one step of RL. Each stage lives in :mod:`rlite.stages` and returns its
product, which the next stage takes: the rollouts' :class:`~rlite.stages.collect.Rollout` (the scored batch),
the targets' :class:`~rlite.stages.targets.PreparedTargets`, the policy's
:class:`~rlite.stages.update.PolicyUpdate`, the report's metrics. The run's components (rollouts, targets,
policy, weight sync, recorder, checkpointer) are built once by :func:`rlite.run.build.build_run`, each by its
own builder. ``run_training(config)`` builds, trains and tears down.
"""

from __future__ import annotations

import logging
from typing import Any

from rlite.config import RunConfig
from rlite.distributed import init_distributed, shutdown_distributed
from rlite.engines.supervisor import EngineGaveUp
from rlite.hf_models import quiet_transformers_progress
from rlite.metrics import merge_reported
from rlite.plugin_manager import RlitePluginManager, get_plugin_manager, plugin_manager_in_use
from rlite.run.build import Run, build_run, sandbox_hidden_paths
from rlite.run.evaluation import evaluate
from rlite.run.faults import Preemption, RunStopped, latest_checkpoint_text, stop_on_full_disk
from rlite.run.lifecycle import check_resume_config, finish_run, stop_after_engine_failure
from rlite.run.status import finished_checkpoint
from rlite.sandbox import hidden_from_programs
from rlite.stages.collect import Rollout
from rlite.stages.report import StepTokens, step_metrics
from rlite.stages.targets import PreparedTargets
from rlite.stages.update import PolicyUpdate

log = logging.getLogger(__name__)


def train(run: Run) -> dict[str, Any]:
    cfg, hook, recorder, checkpointer = run.config, run.pm.hook, run.recorder, run.checkpointer
    recorder.begin()  # the progress line
    hook.on_run_start(config=cfg, run_dir=run.run_dir)
    if run.preemption.requested():  # signalled while the run was being built
        raise run.preemption.stop_before_training(run.run_dir, run.start_step)
    if run.start_step == 0 and run.evaluation.has_prompts:
        with recorder.phase("eval"):
            recorder.log(0, evaluate(run, 0))  # the baseline the run is measured against
    for step in range(run.start_step + 1, cfg.training.steps + 1):
        recorder.step_started(step)
        checkpointer.step_started(step)  # where a run that must stop can save exactly (an engine that died)
        # 1-2. rollout from the engine's current weights, then rewards (a failing reward function
        # scores 0 and is counted); dynamic sampling may draw extra rounds
        rollout = run.rollouts.collect(step)
        if step > 1 and run.preemption.requested():  # SIGTERM: the policy is as the previous step left it
            raise checkpointer.stop_for_preemption()

        # 3. pi_old and pi_ref log-probs, KL-in-reward, corrections, advantages (MoE: routing metrics)
        with recorder.phase("logprobs"):
            prepared = run.targets.prepare(rollout.batch)

        # 4. policy update (mini-batches x micro-batches), then the critic's; a NaN/inf loss or gradient is skipped
        with recorder.phase("train"):
            update = run.policy.update(step, rollout.batch, prepared.targets)
        hook.after_optimizer_step(step=step, model=run.policy.model, metrics=update.metrics)
        checkpointer.policy_moved(step)  # a stop from here saves this step

        # 4b. the speculative draft learns from the same rollouts (its own model: nothing reaches the policy)
        if run.draft is not None:
            with recorder.phase("draft"):
                update.metrics.update(run.draft.update(rollout.batch))

        # 5. the step's metrics so far, held: an engine that dies for good at the sync or the evaluation stops
        # the run with this step's checkpoint, which must come with this step's row
        metrics, tokens = report_step(run, rollout, prepared, update)
        recorder.hold(metrics)

        # 6. the engine samples the next batch from exactly these weights
        sync_weights(run, step)

        # 7. evaluation, the metrics row, then checkpoint
        if cfg.training.eval_every and step % cfg.training.eval_every == 0 or step == cfg.training.steps:
            with recorder.phase("eval"):
                metrics.update(evaluate(run, step))
        recorder.end_step(step, metrics, tokens, pi_old_recomputed=prepared.mismatch_measured)
        recorder.log_samples(step, rollout.batch, prepared.targets)
        # after logging, so a run resumed from this checkpoint has every step's metrics exactly once
        # (the save's time shows up in the next step's time/checkpoint)
        if checkpoint_due(cfg, step):
            checkpointer.save(step)
        if run.preemption.requested():  # SIGTERM or Ctrl-C: this step's checkpoint, then exit (status 75)
            raise checkpointer.stop_for_preemption()
    recorder.end_training()
    return finish_run(run)


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


def report_step(run: Run, rollout: Rollout, prepared: PreparedTargets,
                update: PolicyUpdate) -> tuple[dict[str, float], StepTokens]:
    """Stage 5: the step's metrics every rank agrees on (:func:`rlite.stages.report.step_metrics`) with the
    targets' and the update's, and the global token counts. The mismatch against the engine is measured on the
    first training forward unless the targets measured it on a recomputed pi_old."""
    metrics, tokens = step_metrics(
        rollout.batch, update.first_pass_logprobs, rollout.reward_stats, measure_mismatch=not prepared.mismatch_measured,
        dp_group=run.policy.layout.group, speculation=rollout.speculation,
        reported=merge_reported([rollout.engine_report, *run.policy.drain_reports()]),
    )
    metrics.update(prepared.metrics)
    metrics.update(update.metrics)
    return metrics, tokens


def sync_weights(run: Run, step: int) -> None:
    """Stage 6: the policy's weights to the engine, as version ``step`` (asynchronous rollouts: between two
    generations, never in the middle of one)."""
    with run.recorder.phase("weight_sync"), run.rollouts.exclusive_engine(step):
        run.weight_sync.send(run.engine, step)
    run.rollouts.weights_synced(step)
    run.pm.hook.after_weight_sync(step=step, weight_version=step, engine=run.engine)


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    """A periodic checkpoint (``checkpoint.every``), or the final one (``checkpoint.save_final``)."""
    return bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0
                or step == cfg.training.steps and cfg.checkpoint.save_final)


def close_run(run: Run) -> None:
    """Stop what samples in the background, the engine, the trained models and the reward workers."""
    run.rollouts.close()
    run.engine.shutdown()
    run.policy.close()
    run.rollouts.scoring.close()


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
                    run = build_run(cfg, run_pm, preemption=preemption)
            except EngineGaveUp as failure:  # it kept dying while starting or at the first sync: nothing ran
                raise RunStopped(f"{failure}. No step ran in this run; {latest_checkpoint_text(cfg.logging.run_dir)}") from None
            try:
                with stop_on_full_disk("the run's files", run.run_dir, run.run_dir):
                    summary = train(run)
            except EngineGaveUp as failure:  # dead past its restarts: a checkpoint and a message, no traceback
                try:
                    stopped = stop_after_engine_failure(run, failure)  # logs the step's row first: loggers still open
                finally:
                    run.recorder.close_after_failure()
                raise stopped from None
            except BaseException:
                run.recorder.close_after_failure()
                raise
            finally:
                close_run(run)
        finished = True
        return summary
    finally:
        if owned:
            preemption.uninstall()
        shutdown_distributed(ctx, finished=finished)
