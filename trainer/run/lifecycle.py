"""A run's checkpoints and its end: save, resume, and export/plot/summary when training finishes.

The checkpoint holds the backend's model and optimizer state (and the critic's) in
``torch.distributed.checkpoint`` shards, plus per-rank trainer state: the LR scheduler, the prompt
sampler's position, the KL controller and a trained speculative draft (weights and optimizer)
(:mod:`rlite.run.checkpoint` is the folder format).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlite.data import PromptSampler
from rlite.distributed import DistContext
from rlite.drafts import SpeculativeDraft
from rlite.kl_control import KLController
from rlite.training.backend import CriticModel, TrainingBackend

if TYPE_CHECKING:
    from rlite.run.build import Run

log = logging.getLogger("rlite")


def model_state(backend: TrainingBackend, critic: CriticModel | None) -> dict[str, Any]:
    state = backend.checkpoint_state()
    if critic is not None:
        state.update(critic.checkpoint_state())
    return state


def save_run_checkpoint(run: Run, step: int) -> Path:
    from rlite.run.checkpoint import save_checkpoint

    trainer_state = {
        "scheduler": run.backend.lr_scheduler_state(),
        "sampler": run.sampler.state_dict(),
        "kl_controller": run.kl_controller.state_dict(),
    }
    if run.draft is not None:
        trainer_state["draft"] = run.draft.state_dict()
    path = save_checkpoint(
        run.run_dir,
        step,
        model_state(run.backend, run.critic),
        trainer_state,
        rank=run.ctx.rank,
        keep_last=run.config.checkpoint.keep_last,
        provenance=dict(run.provenance, weight_version=step),  # the weights of step s are version s
    )
    run.backend.after_checkpoint()
    run.pm.hook.on_checkpoint_save(step=step, path=path)
    return path


def maybe_resume(
    resume: str,
    run_dir: Path,
    backend: TrainingBackend,
    critic: CriticModel | None,
    sampler: PromptSampler,
    kl_controller: KLController,
    ctx: DistContext,
    pm,
    draft: SpeculativeDraft | None = None,
) -> int:
    """Load the checkpoint that ``checkpoint.resume`` names, if any; return the step it holds (0: none)."""
    from rlite.run.checkpoint import find_resume_checkpoint, load_checkpoint

    path = find_resume_checkpoint(run_dir, resume)
    if path is None:
        return 0
    state = model_state(backend, critic)
    trainer_state = load_checkpoint(path, state, rank=ctx.rank)
    backend.load_checkpoint_state(state)
    if critic is not None:
        critic.load_checkpoint_state(state)
    backend.load_lr_scheduler_state(trainer_state["scheduler"])
    sampler.load_state_dict(trainer_state["sampler"])
    kl_controller.load_state_dict(trainer_state["kl_controller"])
    if draft is not None and trainer_state.get("draft"):  # a run that had no draft before starts it afresh
        draft.load_state_dict(trainer_state["draft"])
    step = int(trainer_state["step"])
    if ctx.is_main:
        log.info("resumed from %s (step %d)", path, step)
    pm.hook.on_checkpoint_load(step=step, path=path)
    return step


def finish_run(run: Run, last: dict[str, float]) -> dict[str, Any]:
    """Export, plot, print the summary and the time breakdown; the summary is read from the metrics
    file, so a resumed (or already finished) run reports its whole history."""
    from rlite.metrics import plot_run, print_summary
    from rlite.stages.report import summarize_metrics

    cfg = run.config
    if cfg.checkpoint.export_hf:
        from rlite.run.export import export_hf

        export_hf(run.backend, run.tokenizer, run.run_dir / "hf_model", is_main=run.ctx.is_main)
        if run.draft is not None and run.ctx.is_main:  # every rank holds the same draft
            run.draft.export(run.run_dir / "hf_draft")
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


def log_metrics(run: Run, step: int, metrics: dict[str, float]) -> None:
    if run.ctx.is_main:
        for logger in run.loggers:
            logger.log(step, metrics)
        run.pm.hook.on_metrics(step=step, metrics=metrics)
