"""A run's start and end: resuming from a checkpoint (and refusing one of another model or algorithm), the stop
after an engine failure, and export/plot/summary when training finishes. Saving checkpoints is the
:class:`~rlite.run.checkpointer.Checkpointer`'s.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlite.config import ConfigError, RunConfig
from rlite.data import PromptSampler
from rlite.distributed import DistContext
from rlite.drafts import SpeculativeDraft
from rlite.errors import RunStopped
from rlite.run.faults import stop_on_full_disk
from rlite.run.policy import Models, model_state
from rlite.run.state import Run
from rlite.stages.kl_control import KLController

log = logging.getLogger("rlite")


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


def stop_after_engine_failure(run: Run, failure: Exception) -> RunStopped:
    """The :class:`~rlite.run.faults.RunStopped` for an engine that died past its restarts: the
    checkpoint of the last step whose state can be written exactly (the step in progress is redone
    on resume when its policy update had not started), after that step's row."""
    step = run.checkpointer.last_whole_step
    run.recorder.log_held(step)  # the policy moved: this step's checkpoint comes with its row
    if step == 0:
        saved = "no step had finished, so a re-run starts from the beginning"
    else:
        saved = f"saved the checkpoint of step {step} ({run.checkpointer.save_for_stop()}); run the same command again to resume from it"
        if run.config.checkpoint.resume == "never":
            saved += " with checkpoint.resume=auto"
    return RunStopped(f"{failure}. The run stops: {saved}")


@dataclass(frozen=True)
class Resumed:
    """What :func:`maybe_resume` loaded beyond the state it put into the models, the sampler, the KL controller
    and the draft."""

    step: int
    """The step the checkpoint holds (0: a fresh run)."""
    rollouts_ahead: dict
    """The batches an asynchronous run had sampled beyond it (:meth:`rlite.stages.collect.Rollouts.resume_ahead`)."""


def maybe_resume(
    path: Path | None,
    models: Models,
    sampler: PromptSampler,
    kl_controller: KLController,
    ctx: DistContext,
    pm,
    draft: SpeculativeDraft | None = None,
) -> Resumed:
    """Load the checkpoint ``path`` (:func:`~rlite.run.checkpoint.find_resume_checkpoint`'s choice), if
    any, into the models, the sampler, the KL controller and the draft; what else it held (:class:`Resumed`)."""
    from rlite.run.checkpoint import load_checkpoint

    if path is None:
        return Resumed(0, {})
    backend, critic = models.backend, models.critic
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
        rollouts_ahead = dict(trainer_state.get("rollouts_ahead") or {})
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
    return Resumed(step, rollouts_ahead)


def finish_run(run: Run) -> dict[str, Any]:
    """Export, plot, print the summary and the time breakdown; the summary is read from the metrics
    file, so a resumed (or already finished) run reports its whole history."""
    cfg, recorder = run.config, run.recorder
    summary: dict[str, Any] = {"steps": cfg.training.steps, "run_dir": str(run.run_dir)}
    if cfg.checkpoint.export_hf:
        summary["exported_model"] = export_models(run)
    recorder.close_loggers()
    if run.ctx.is_main:
        summarize_run(run, summary)
    summary["time_breakdown"] = dict(recorder.timer.total)
    run.pm.hook.on_run_end(config=cfg, summary=summary)
    return summary


def export_models(run: Run) -> str:
    """The policy as a Hugging Face folder (``<run_dir>/hf_model``; a collective) and a draft, if any, beside it;
    the policy's folder."""
    from rlite.run.export import export_hf

    out = run.run_dir / "hf_model"
    with stop_on_full_disk("the exported model", out, run.run_dir):
        export_hf(run.policy.backend, run.tokenizer, out, is_main=run.ctx.is_main, source_model=run.config.model.path)
    if run.draft is not None and run.ctx.is_main:  # every rank holds the same draft
        with stop_on_full_disk("the exported draft model", run.run_dir / "hf_draft", run.run_dir):
            run.draft.export(run.run_dir / "hf_draft")
    return str(out.resolve())


def summarize_run(run: Run, summary: dict[str, Any]) -> None:
    """The main rank's summary lines (from the metrics file) and the plot added to ``summary``, then printed."""
    import time

    from rlite.metrics import format_duration, plot_run, print_summary
    from rlite.stages.report import summarize_metrics

    recorder, metrics_file = run.recorder, run.run_dir / "metrics.jsonl"
    summary.update(summarize_metrics(metrics_file, recorder.last))
    if run.config.logging.plot and metrics_file.is_file():
        with stop_on_full_disk("the plot", run.run_dir / "plot.png", run.run_dir):
            summary["plot"] = str(plot_run(metrics_file, run.run_dir / "plot.png"))
    summary["wall_time"] = format_duration(time.perf_counter() - recorder.started)
    print_summary(summary, dict(recorder.timer.total))
