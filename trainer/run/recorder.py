"""What a run writes down, as a run's component (:class:`Recorder`): the metric rows (the loggers and the
``on_metrics`` hook, rank 0), the samples people read, the phase timer, the progress line, the warning when
nothing can learn, the profiler and the ``perf/*`` meter; built by :func:`build_recorder`, its loggers by
:func:`open_run_logs` before the engine starts.

A step's row is held (:meth:`Recorder.hold`) from the moment the policy has moved until it is logged, so that a
run stopped in between (an engine dead past its restarts) logs it with that step's checkpoint
(:meth:`Recorder.log_held`): a resumed run then has every step's row exactly once.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlite.config import ConfigError, RunConfig
from rlite.config.advantage import advantage_choice
from rlite.distributed import DistContext
from rlite.metrics import LearningSignalWatch, Logger, ProgressBar, StepProfiler, StepTimer, trim_metrics_file
from rlite.perf import PerfMeter
from rlite.plugin_manager import RlitePluginManager, resolve_choice
from rlite.rollout import ScoredBatch, TrainTargets
from rlite.run.faults import stop_on_full_disk
from rlite.run.provenance import append_metrics_record
from rlite.samples import SampleWriter, train_sample_rows
from rlite.stages.report import StepTokens

log = logging.getLogger("rlite")

@dataclass(frozen=True)
class SampleSchedule:
    """Which training rollouts are written for people to read (``logging.samples_every``, ``samples_per_step``)."""

    every: int
    count: int
    last_step: int
    """``training.steps``: the last step's samples are always written."""
    reward_names: list[str]
    """The reward functions, one per column of ``reward_components``."""
    tokenizer: Any
    """Decodes each prompt's tokens into ``prompt_text``."""


@dataclass(frozen=True)
class ProgressSettings:
    """The progress line of :class:`rlite.metrics.ProgressBar` (``logging.progress_bar``, ``log_every``)."""

    total: int
    start: int
    enabled: bool
    plain_every: int


class Recorder:
    """What a run writes down (the module docstring). What changes during a run lives here, behind methods:
    the progress display (opened by :meth:`begin`), the step's clock, the held row, the last row."""

    def __init__(self, *, run_dir: Path, is_main: bool, hooks: Any, loggers: list[Logger], samples: SampleWriter | None,
                 schedule: SampleSchedule, timer: StepTimer, perf: PerfMeter | None, watch: LearningSignalWatch,
                 profiler: StepProfiler, progress: ProgressSettings, started: float) -> None:  # fmt: skip
        self.run_dir, self.is_main, self.hooks = run_dir, is_main, hooks
        self.loggers, self.samples, self.schedule = loggers, samples, schedule
        self.timer, self.perf, self.watch, self.profiler = timer, perf, watch, profiler
        self.progress_settings = progress
        self.started = started
        """``time.perf_counter()`` when the run started being built (``perf/wall_s`` and the summary count from it)."""
        self.progress: ProgressBar | None = None
        self.step_clock = started
        self.held: dict[str, float] | None = None
        self.last: dict[str, float] = {}
        """The last step's row (the summary falls back on it when no metrics file was written)."""

    def phase(self, name: str) -> AbstractContextManager:
        """Time a phase of the step (``time/<name>``)."""
        return self.timer.phase(name)

    def begin(self) -> None:
        """Training starts: open the progress display (a rich bar on a terminal, else plain lines)."""
        p = self.progress_settings
        self.progress = ProgressBar(p.total, p.start, p.enabled, plain_every=p.plain_every)

    def step_started(self, step: int) -> None:
        self.step_clock = time.perf_counter()
        self.profiler.before_step(step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """A row: to every logger (metrics.jsonl, TensorBoard's event file, ...) and the ``on_metrics`` hook, on
        rank 0; a full disk stops the run, naming the logger."""
        if not self.is_main:
            return
        for logger in self.loggers:
            with stop_on_full_disk(f"the metrics of step {step} ({type(logger).__name__})", self.run_dir, self.run_dir):
                logger.log(step, metrics)
        self.hooks.on_metrics(step=step, metrics=metrics)

    def hold(self, metrics: dict[str, float]) -> dict[str, float]:
        """Hold the step's row so far (it grows until :meth:`end_step` logs it); returned for the caller to add to."""
        self.held = metrics
        return metrics

    def log_held(self, step: int) -> None:
        """Log the held row (with the step's times so far), if a row is held: its step's checkpoint is saved next."""
        if self.held is not None:
            self.log(step, {**self.held, **self.timer.step_metrics()})
            self.held = None

    def end_step(self, step: int, metrics: dict[str, float], tokens: StepTokens, *, pi_old_recomputed: bool) -> None:
        """The step's row completed (its ``time/*`` and ``perf/*``) and logged; the progress line, the
        learning-signal watch and the profiler told."""
        metrics.update(self.timer.step_metrics())
        metrics["perf/tokens_per_s"] = tokens.generated / max(time.perf_counter() - self.step_clock, 1e-9)
        if self.perf is not None:
            metrics.update(self.perf.step_metrics(tokens.sequences, metrics, pi_old_recomputed=pi_old_recomputed))
        metrics["perf/wall_s"] = time.perf_counter() - self.started  # since this command began building the run
        self.log(step, metrics)
        self.held = None
        if self.progress is not None:
            self.progress.update(step, metrics)
        self.watch.observe(step, metrics)
        self.profiler.after_step(step)
        self.last = metrics

    def log_samples(self, step: int, batch: ScoredBatch, targets: TrainTargets) -> None:
        """Rank 0's first rollouts of the step, every ``logging.samples_every`` steps and at the last."""
        schedule = self.schedule
        if self.samples is not None and (step % schedule.every == 0 or step == schedule.last_step):
            rows = train_sample_rows(batch, targets, step, schedule.count, schedule.reward_names,
                                     tokenizer=schedule.tokenizer)
            self.write_samples(step, "train", rows)

    def write_samples(self, step: int, kind: str, rows: list[dict]) -> None:
        """``samples.jsonl`` and the loggers that show samples (nothing where no samples are written); a full
        disk stops the run cleanly."""
        if self.samples is None:
            return
        with stop_on_full_disk(f"the samples of step {step}", self.samples.path, self.run_dir):
            self.samples.write(step, kind, rows)

    def end_training(self) -> None:
        """The last step is done: close the progress display and the profiler."""
        if self.progress is not None:
            self.progress.close()
        self.profiler.close()

    def close_loggers(self) -> None:
        """A run's normal end: what the loggers buffer reaches their files (a full disk stops it cleanly)."""
        if self.is_main:
            with stop_on_full_disk("the metrics (closing the loggers)", self.run_dir, self.run_dir):
                for logger in self.loggers:
                    logger.close()

    def close_after_failure(self) -> None:
        """Close the loggers of a run that stopped early: what they buffer reaches their files and W&B ends its
        run, also for a rank that leaves through ``os._exit`` (:func:`rlite.distributed.leave_rank_process`),
        where no interpreter exit would. A failure to close is logged, not raised over the one that stopped the run."""
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as exc:  # noqa: BLE001  (the failure that stopped the run is the one to report)
                log.warning("closing the %s logger after the run stopped failed: %s", type(logger).__name__, exc)


def group_relative(cfg: RunConfig, pm: RlitePluginManager) -> bool:
    """The advantage estimator's baseline comes from the other samples of a prompt (registered with
    ``needs_group``): a group whose rewards are all equal then gets zero advantages. A critic's or a
    greedy baseline's advantages do not vanish that way, so only these runs are watched for it."""
    return advantage_choice(cfg.algorithm, pm.registries).group_baseline


def build_recorder(cfg: RunConfig, pm: RlitePluginManager, ctx: DistContext, *, loggers: list[Logger], timer: StepTimer,
                   perf: PerfMeter | None, start_step: int, started: float, reward_names: list[str], tokenizer: Any,
                   training: bool = True) -> Recorder:  # fmt: skip
    """The run's :class:`Recorder`; ``perf``: the run's ``perf/*`` meter (``None``: none); ``training``: false for
    ``rlite eval``, which shows no progress line."""
    run_dir = Path(cfg.logging.run_dir)
    writes_samples = ctx.is_main and bool(cfg.logging.samples_every)
    return Recorder(
        run_dir=run_dir, is_main=ctx.is_main, hooks=pm.hook, loggers=loggers,
        samples=SampleWriter(run_dir / "samples.jsonl", loggers) if writes_samples else None,
        schedule=SampleSchedule(cfg.logging.samples_every, cfg.logging.samples_per_step, cfg.training.steps,
                                reward_names, tokenizer),
        timer=timer, perf=perf,
        watch=LearningSignalWatch(enabled=ctx.is_main and group_relative(cfg, pm)),  # most groups' rewards all equal?
        profiler=StepProfiler(cfg.logging.profile, start_step, run_dir, ctx.rank),
        progress=ProgressSettings(cfg.training.steps, start_step, training and cfg.logging.progress_bar and ctx.is_main,
                                  cfg.logging.log_every),
        started=started,
    )  # fmt: skip


def open_run_logs(cfg: RunConfig, pm: RlitePluginManager, ctx: DistContext, start_step: int, provenance: dict,
                  *, training: bool = True) -> list[Logger]:
    """On the main rank of a training run: ``metrics.jsonl`` and ``samples.jsonl`` cut back to the step the run
    resumes from, this run's provenance record, and the loggers (``logging.loggers``), told where the run
    resumes; else no loggers."""
    if not (ctx.is_main and training):
        return []
    run_dir = Path(cfg.logging.run_dir)
    for name in ("metrics.jsonl", "samples.jsonl"):
        trim_metrics_file(run_dir / name, start_step if start_step else None)
    # the first row of a fresh run's metrics (a resumed run keeps it and adds its own)
    append_metrics_record(run_dir / "metrics.jsonl", start_step, provenance)
    loggers = build_loggers(cfg, run_dir, pm)
    for logger in loggers:  # steps an interrupted run logged after the checkpoint are logged again
        if start_step and callable(getattr(logger, "resume", None)):
            logger.resume(start_step)
    return loggers


def build_loggers(cfg: RunConfig, run_dir: Path, pm: RlitePluginManager) -> list[Logger]:
    """``logging.loggers``, each built by its factory (None: it cannot run here, and is left out); an object
    that is no :class:`~rlite.metrics.Logger` (no ``log`` or ``close``) is refused, naming the plugin."""
    loggers = []
    registry = pm.registry("logger")
    for choice in cfg.logging.loggers:
        factory, logger_cfg = resolve_choice(registry, choice)
        logger = factory(run_dir, cfg, logger_cfg)
        if logger is None:
            continue
        missing = [name for name in ("log", "close") if not callable(getattr(logger, name, None))]
        if missing:
            entry = registry.get(choice.name)
            raise ConfigError(
                f"logging.loggers: the {choice.name!r} logger of plugin {entry.plugin!r} built a "
                f"{type(logger).__name__} without {' and '.join(missing)}(): a logger implements rlite.api.Logger"
            )
        loggers.append(logger)
    return loggers
