"""Built-in metric loggers: ``jsonl`` (always works), ``tensorboard`` and ``wandb`` (when installed).

A logger factory is ``factory(run_dir, config, cfg) -> logger``; the logger implements ``rlite.api.Logger``
(``log(step, metrics)`` and ``close()``, and where it can, ``log_samples(step, kind, rows)``, rows as in
``samples.jsonl``, and ``resume(step)``: forget what an interrupted run logged after the checkpoint a run resumes
from). A factory returns None when its package is missing, which the loop reports once and skips.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from rlite.api import Logger, hookimpl, open_run_file

log = logging.getLogger(__name__)


class JsonlLogger(Logger):
    """One JSON object per step in ``<run_dir>/metrics.jsonl``; appends when a run resumes."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.handle = open_run_file(path, "a")  # never through a link: the run folder may be someone else's

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step}
        row.update({k: (v if isinstance(v, (int, str)) or math.isfinite(v) else None) for k, v in metrics.items()})
        self.handle.write(json.dumps(row) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


@dataclass
class JsonlConfig:
    filename: str = "metrics.jsonl"
    """File name inside the run folder."""


def make_jsonl(run_dir, config, cfg: JsonlConfig):
    return JsonlLogger(Path(run_dir) / cfg.filename)


class TensorBoardLogger(Logger):
    """Scalars per step under ``<run_dir>/tensorboard``, and rollouts as text tables.

    Each run starts its events with a session start (TensorBoard's ``SessionLog.START``), which
    TensorBoard reads as "drop every earlier event from this step on": at step 0 for a fresh run (a new
    history in the same folder) and at ``step + 1`` for a run resumed from a checkpoint of ``step``
    (what ``SummaryWriter(purge_step=...)`` writes), so the steps an interrupted run logged after its
    checkpoint show once, not twice."""

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(logdir))
        self.session_start: int | None = 0

    def resume(self, step: int) -> None:
        self.session_start = step + 1

    def _start_session(self) -> None:
        if self.session_start is None:
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        start = SessionLog(status=SessionLog.START)
        self.writer.file_writer.add_event(Event(step=self.session_start, session_log=start))
        self.session_start = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._start_session()
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_samples(self, step: int, kind: str, rows: list[dict]) -> None:
        """A markdown table under ``samples/<kind>`` (TensorBoard's Text tab)."""
        from rlite.api import samples_markdown

        self._start_session()
        self.writer.add_text(f"samples/{kind}", samples_markdown(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def make_tensorboard(run_dir, config, cfg=None):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        log.info("tensorboard is not installed (pip install rlite[tensorboard]); skipping that logger")
        return None
    return TensorBoardLogger(Path(run_dir) / "tensorboard")


@dataclass
class WandbConfig:
    project: str = "rlite"
    """W&B project."""
    mode: str = "offline"
    """W&B mode: online, offline or disabled."""
    entity: str | None = None
    """W&B entity (team or user); None: the account's default."""
    name: str | None = None
    """The run's display name; None: the run folder's name (``logging.run_dir``)."""
    group: str | None = None
    """W&B group, to show several runs (seeds, ablations) together."""
    tags: list[str] = field(default_factory=list)
    """W&B tags."""


class WandbLogger(Logger):
    """Metrics and sample tables in one W&B run per rlite run: the W&B run's id is kept in
    ``<run_dir>/wandb/rlite_run_id``, and a resumed rlite run continues that W&B run
    (``resume="allow"``) instead of starting a second one. W&B keeps steps increasing, so the steps an
    interrupted run logged after its checkpoint keep their first values (a resumed run repeats them
    bitwise, timings aside); the resumed run logs from the step after the last one W&B holds."""

    ID_FILE = "rlite_run_id"

    def __init__(self, run_dir, config, cfg: WandbConfig) -> None:
        self.run_dir, self.config, self.cfg = Path(run_dir), config, cfg
        self.run = None
        self.resumed_from: int | None = None
        self.first_due = 0
        """The first step W&B does not hold yet (steps are increasing there)."""

    def resume(self, step: int) -> None:
        self.resumed_from = step

    def _start(self):
        if self.run is not None:
            return self.run
        import dataclasses
        import uuid

        import wandb

        folder = self.run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / self.ID_FILE
        if self.resumed_from is not None and id_file.is_file():  # the same W&B run, continued
            run_id, resume = id_file.read_text().strip(), "allow"
        else:  # a fresh run (also a fresh start in an old folder: checkpoint.resume=never)
            run_id, resume = uuid.uuid4().hex[:8], None
            id_file.write_text(run_id + "\n")
        cfg = self.cfg
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, name=cfg.name or self.run_dir.resolve().name, group=cfg.group,
            tags=list(cfg.tags) or None, mode=cfg.mode, dir=str(self.run_dir), id=run_id, resume=resume,
            config=dataclasses.asdict(self.config),
        )  # fmt: skip
        if resume:  # online, W&B knows where the run got to; offline it starts at 0
            self.first_due = self.run.step
        return self.run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        run = self._start()
        if step >= self.first_due:
            run.log(metrics, step=step)

    def log_samples(self, step: int, kind: str, rows: list[dict]) -> None:
        """A ``wandb.Table`` under ``samples/<kind>``, one row per rollout."""
        import json

        import wandb

        run = self._start()
        if step < self.first_due:
            return
        columns = sorted({key for row in rows for key in row})
        data = [[v if isinstance(v, (int, float, str, type(None))) else json.dumps(v, default=str)
                 for v in (row.get(c) for c in columns)] for row in rows]  # fmt: skip
        run.log({f"samples/{kind}": wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def make_wandb(run_dir, config, cfg: WandbConfig):
    try:
        import wandb  # noqa: F401
    except ImportError:
        log.warning("logging.loggers lists wandb but it is not installed: pip install rlite[wandb]")
        return None
    return WandbLogger(run_dir, config, cfg)


@hookimpl
def register_loggers(register):
    register("jsonl", make_jsonl, JsonlConfig)
    register("tensorboard", make_tensorboard)
    register("wandb", make_wandb, WandbConfig)
