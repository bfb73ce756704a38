"""A run's checkpoints and its end: save, resume, and export/plot/summary when training finishes.

The checkpoint holds the backend's model and optimizer state (and the critic's) in
``torch.distributed.checkpoint`` shards, plus per-rank trainer state: the LR scheduler, the prompt
sampler's position, the KL controller and a trained speculative draft (weights and optimizer)
(:mod:`rlite.run.checkpoint` is the folder format).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from rlite.config import ConfigError, RunConfig
from rlite.data import PromptSampler
from rlite.distributed import DistContext
from rlite.drafts import SpeculativeDraft
from rlite.kl_control import KLController
from rlite.run.faults import stop_on_full_disk
from rlite.run.state import Run
from rlite.training.backend import CriticModel, TrainingBackend

log = logging.getLogger("rlite")


def model_state(backend: TrainingBackend, critic: CriticModel | None) -> dict[str, Any]:
    state = backend.checkpoint_state()
    if critic is not None:
        state.update(critic.checkpoint_state())
    return state


def save_run_checkpoint(run: Run, step: int) -> Path:
    from rlite.run.checkpoint import CheckpointWriteError, save_checkpoint
    from rlite.run.faults import RunStopped

    trainer_state = {
        "scheduler": run.backend.lr_scheduler_state(),
        **run.rollouts.checkpoint_state(step),  # the prompt position (and batches sampled ahead: async)
        "kl_controller": run.kl_controller.state_dict(),
    }
    if run.draft is not None:
        trainer_state["draft"] = run.draft.state_dict()
    try:
        path = save_checkpoint(
            run.run_dir,
            step,
            model_state(run.backend, run.critic),
            trainer_state,
            rank=run.ctx.rank,
            keep_last=run.config.checkpoint.keep_last,
            provenance=dict(run.provenance, weight_version=step),  # the weights of step s are version s
        )
    except CheckpointWriteError as exc:  # a full disk: stop with the folder and its free space named
        raise RunStopped(str(exc)) from None
    run.backend.after_checkpoint()
    run.pm.hook.on_checkpoint_save(step=step, path=path)
    return path


RESUME_CHECKED_SECTIONS = ("model", "algorithm")
"""Config sections that must match the checkpoint's run for a resume (``checkpoint.resume_mismatch``)."""


def _differences(saved: Any, current: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved value, current value)`` for every leaf that differs."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            out += _differences(saved.get(key), current.get(key), f"{prefix}.{key}")
        return out
    return [] if saved == current else [(prefix, saved, current)]


def check_resume_config(cfg: RunConfig, path: Path | None) -> None:
    """Refuse to resume the checkpoint ``path`` (``None``: a fresh run) if its run had another model or
    algorithm (unless ``checkpoint.resume_mismatch=allow``); run before this run writes its own ``config.yaml``.

    The checkpoint's run is described by the ``config.yaml`` of its run folder
    (``<run_dir>/checkpoints/step_X`` -> ``<run_dir>/config.yaml``).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if path is None:
        return
    from rlite.run_files import read_run_file

    saved_file = path.parent.parent / "config.yaml"
    if not os.path.lexists(saved_file):
        log.warning("resuming %s: its run folder has no config.yaml to check the model and algorithm against", path)
        return
    try:  # data: read without following a link, no interpolation resolved
        saved = OmegaConf.to_container(OmegaConf.create(read_run_file(saved_file).decode("utf-8")), resolve=False) or {}
    except (UnicodeDecodeError, ValueError, OmegaConfBaseException) as exc:
        raise ConfigError(f"checkpoint.resume: {saved_file} is not the YAML config rlite writes ({type(exc).__name__}); "
                          "resume from another run folder, or start afresh") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"checkpoint.resume: {saved_file} is not the config rlite writes (a mapping of sections)")
    current = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=False)
    differ = [d for section in RESUME_CHECKED_SECTIONS for d in _differences(saved.get(section), current[section], section)]
    if not differ:
        return
    listed = "; ".join(f"{key}: {old!r} then, {new!r} now" for key, old, new in differ[:8])
    listed += f"; and {len(differ) - 8} more" if len(differ) > 8 else ""
    if cfg.checkpoint.resume_mismatch == "allow":
        log.warning("resuming %s although its run had another model or algorithm (%s)", path, listed)
        return
    raise ConfigError(
        f"checkpoint.resume: {str(path)!r} was written by a run with another model or algorithm ({listed}). Start "
        "this run in its own folder (logging.run_dir=...) or afresh (checkpoint.resume=never, which replaces that "
        "run's files), or resume it anyway with checkpoint.resume_mismatch=allow"
    )


def step_start_state(run: Run) -> dict[str, Any]:
    """What a step changes before its policy update (the prompt position, the RNG states, the KL
    controller): enough to save the previous step's checkpoint if the step is abandoned there."""
    from rlite.run.checkpoint import rng_state

    return {"sampler": run.sampler.state_dict(), "kl_controller": run.kl_controller.state_dict(), "rng": rng_state()}


def save_at_boundary(run: Run, step: int, at_start: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``step`` (unless it is on disk already) for a run that stops. ``at_start``:
    the step after ``step`` was abandoned before its policy update; its :func:`step_start_state` is put
    back first, so the checkpoint is exactly the one a save at the end of ``step`` would have written."""
    from rlite.run.checkpoint import checkpoint_root, list_checkpoints, set_rng_state

    if at_start is not None:
        run.sampler.load_state_dict(at_start["sampler"])
        run.kl_controller.load_state_dict(at_start["kl_controller"])
        set_rng_state(at_start["rng"])
    path = checkpoint_root(run.run_dir) / f"step_{step:08d}"
    if path in list_checkpoints(path.parent):
        return path
    with run.timer.phase("checkpoint"):
        return save_run_checkpoint(run, step)


def save_and_stop_for_preemption(run: Run, step: int, at_start: dict[str, Any] | None = None):
    """The :class:`~rlite.run.faults.RunStopped` to raise after a preemption signal, the checkpoint of
    ``step`` written (:func:`save_at_boundary`)."""
    return run.preemption.stop(step, save_at_boundary(run, step, at_start), run.config.checkpoint.resume)


def stop_after_engine_failure(run: Run, failure: Exception):
    """The :class:`~rlite.run.faults.RunStopped` for an engine that died past its restarts: the
    checkpoint of the last step whose state can be written exactly (the step in progress is redone
    on resume when its policy update had not started)."""
    from rlite.run.faults import RunStopped

    step, at_start = run.in_progress
    if at_start is not None:
        step -= 1
    elif run.unlogged_metrics is not None:  # the policy moved: this step's checkpoint comes with its row
        log_metrics(run, step, {**run.unlogged_metrics, **run.timer.step_metrics()})
        run.unlogged_metrics = None
    if step == 0:
        saved = "no step had finished, so a re-run starts from the beginning"
    else:
        saved = f"saved the checkpoint of step {step} ({save_at_boundary(run, step, at_start)}); run the same command again to resume from it"
        if run.config.checkpoint.resume == "never":
            saved += " with checkpoint.resume=auto"
    return RunStopped(f"{failure}. The run stops: {saved}")


def maybe_resume(
    path: Path | None,
    backend: TrainingBackend,
    critic: CriticModel | None,
    sampler: PromptSampler,
    kl_controller: KLController,
    ctx: DistContext,
    pm,
    draft: SpeculativeDraft | None = None,
    rollouts_ahead: dict | None = None,
) -> int:
    """Load the checkpoint ``path`` (:func:`~rlite.run.checkpoint.find_resume_checkpoint`'s choice), if
    any; return the step it holds (0: none). ``rollouts_ahead`` receives the batches an asynchronous
    run had sampled beyond it (if any)."""
    from rlite.run.checkpoint import load_checkpoint

    if path is None:
        return 0
    state = model_state(backend, critic)
    trainer_state = load_checkpoint(path, state, rank=ctx.rank)
    backend.load_checkpoint_state(state)
    if critic is not None:
        critic.load_checkpoint_state(state)
    try:  # its sections were checked to be of the right types; what they hold is checked by applying them
        backend.load_lr_scheduler_state(trainer_state["scheduler"])
        sampler.load_state_dict(trainer_state["sampler"])
        kl_controller.load_state_dict(trainer_state["kl_controller"])
        if draft is not None and trainer_state.get("draft"):  # a run that had no draft before starts it afresh
            draft.load_state_dict(trainer_state["draft"])
        if rollouts_ahead is not None:
            rollouts_ahead.update(trainer_state.get("rollouts_ahead") or {})
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ConfigError(
            f"checkpoint.resume: the trainer state of {path} does not fit this run ({type(exc).__name__}: {exc}); it is "
            "damaged or not a checkpoint rlite wrote. Point checkpoint.resume at another checkpoint or start fresh "
            "with checkpoint.resume=never"
        ) from None
    step = int(trainer_state["step"])
    if ctx.is_main:
        log.info("resumed from %s (step %d)", path, step)
    pm.hook.on_checkpoint_load(step=step, path=path)
    return step


def finish_run(run: Run, last: dict[str, float]) -> dict[str, Any]:
    """Export, plot, print the summary and the time breakdown; the summary is read from the metrics
    file, so a resumed (or already finished) run reports its whole history."""
    import time

    from rlite.metrics import format_duration, plot_run, print_summary
    from rlite.stages.report import summarize_metrics

    cfg = run.config
    summary: dict[str, Any] = {"steps": cfg.training.steps, "run_dir": str(run.run_dir)}
    if cfg.checkpoint.export_hf:
        from rlite.run.export import export_hf

        with stop_on_full_disk("the exported model", run.run_dir / "hf_model", run.run_dir):
            export_hf(run.backend, run.tokenizer, run.run_dir / "hf_model", is_main=run.ctx.is_main,
                      source_model=cfg.model.path)
        summary["exported_model"] = str((run.run_dir / "hf_model").resolve())
        if run.draft is not None and run.ctx.is_main:  # every rank holds the same draft
            with stop_on_full_disk("the exported draft model", run.run_dir / "hf_draft", run.run_dir):
                run.draft.export(run.run_dir / "hf_draft")
    if run.ctx.is_main:
        with stop_on_full_disk("the metrics (closing the loggers)", run.run_dir, run.run_dir):
            for logger in run.loggers:
                logger.close()
        summary.update(summarize_metrics(run.run_dir / "metrics.jsonl", last))
        if cfg.logging.plot and (run.run_dir / "metrics.jsonl").is_file():
            with stop_on_full_disk("the plot", run.run_dir / "plot.png", run.run_dir):
                summary["plot"] = str(plot_run(run.run_dir / "metrics.jsonl", run.run_dir / "plot.png"))
        summary["wall_time"] = format_duration(time.perf_counter() - run.started)
        print_summary(summary, dict(run.timer.total))
    summary["time_breakdown"] = dict(run.timer.total)
    run.pm.hook.on_run_end(config=cfg, summary=summary)
    return summary


def log_samples(run: Run, step: int, batch) -> None:
    """Rank 0's first rollouts of the step, every ``logging.samples_every`` steps and at the last."""
    every = run.config.logging.samples_every
    if run.samples is not None and (step % every == 0 or step == run.config.training.steps):
        from rlite.samples import train_sample_rows

        rows = train_sample_rows(batch, step, run.config.logging.samples_per_step, run.rollouts.scoring.rewards.names,
                                 tokenizer=run.tokenizer)
        write_samples(run, step, "train", rows)


def write_samples(run: Run, step: int, kind: str, rows: list[dict]) -> None:
    """``samples.jsonl`` and the loggers that show samples; a full disk stops the run cleanly."""
    with stop_on_full_disk(f"the samples of step {step}", run.samples.path, run.run_dir):
        run.samples.write(step, kind, rows)


def log_metrics(run: Run, step: int, metrics: dict[str, float]) -> None:
    if run.ctx.is_main:
        for logger in run.loggers:  # metrics.jsonl, TensorBoard's event file, ...
            with stop_on_full_disk(f"the metrics of step {step} ({type(logger).__name__})", run.run_dir, run.run_dir):
                logger.log(step, metrics)
        run.pm.hook.on_metrics(step=step, metrics=metrics)
