"""Step timing, the channel through which components report metrics (:class:`MetricsSink`), the logger
interface (:class:`Logger`), the live progress bar, the warning when nothing can learn, the final plot and
the one-screen summary (rank 0)."""

from __future__ import annotations

import json
import logging
import numbers
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

log = logging.getLogger(__name__)  # "rlite.metrics", under "rlite"


class StepTimer:
    """Wall time per phase of a step; ``timer.phase("generation")`` as a context manager.

    A name with a ``/`` is a part of the phase before it (``train/backward`` inside ``train``): it is
    reported as ``time/train/backward`` and printed under its phase, but not added to
    ``time/step`` a second time."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.total: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.current[name] += elapsed
            self.total[name] += elapsed

    def step_metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.current.items()}
        out["time/step"] = sum(v for k, v in self.current.items() if "/" not in k)
        self.current = defaultdict(float)
        return out


Reported = dict[str, tuple[str, float, int]]
"""What a :class:`MetricsSink` held when drained, as plain data (picklable: it crosses processes and ranks):
``name -> (reduce, total, reports)``."""

REDUCES = ("mean", "sum")

RLITE_PREFIXES = ("actor", "advantage", "batching", "correction", "critic", "draft", "dynamic_sampling", "eval",
                  "mismatch", "perf", "response", "reward", "rollout", "routing", "spec", "train")
"""The first segments of the names rlite's own metrics use: a component's name may not start with one (``time/``
is open, for a component's timings under ``time/<its prefix>/...``)."""


class MetricsSink:
    """Where a component (a rollout engine, a training backend, the process behind an engine) reports numbers
    for the metrics row of the step it works in. Thread-safe; ``docs/plugins.md``, "Reporting metrics".

    ``report({"myengine/cache_hit_rate": 0.8})`` averages a name over every report of the step, on every rank
    (``reduce="mean"``); ``report({"myengine/n_evictions": 3}, reduce="sum")`` adds them up (counts, totals).
    The stage that calls the component drains its sink (:meth:`drain`) into the step's row: an engine's after
    the step's rollout (what it reported since the previous rollout, the weight sync between them included;
    during an evaluation, into ``eval/<name>``), a backend's after the update. A name is ``<prefix>/<name>``
    under a prefix of your own: rlite's (:data:`RLITE_PREFIXES`) are refused; timings go under
    ``time/<prefix>/...``, which the resume comparison leaves out as it does rlite's own.

    **Metrics must equal after a resume**: a run resumed from a checkpoint of step ``k`` must log for the steps
    after ``k`` exactly the rows of the uninterrupted run (``rlite audit`` checks it; ``time/`` and ``perf/``
    names are exempt). Report what the step's own work measured (calls, tokens, hits), never a running total
    since the process started, which restarts from 0 in a resumed run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Reported = {}

    def report(self, values: Mapping[str, float], *, reduce: Literal["mean", "sum"] = "mean") -> None:
        """Add ``values`` (name -> real number) to the step's metrics; ``reduce``: how reports of one name
        combine over calls and ranks. A name is reported with one ``reduce`` only."""
        if reduce not in REDUCES:
            raise ValueError(f"MetricsSink.report: reduce must be one of {', '.join(REDUCES)}, got {reduce!r}")
        checked = {}
        for name, value in values.items():
            if not isinstance(name, str) or "/" not in name.strip("/"):
                raise TypeError(f"MetricsSink.report: a metric name is '<your prefix>/<name>', got {name!r}")
            if name.split("/")[0] in RLITE_PREFIXES:
                raise ValueError(f"MetricsSink.report: {name!r} is under {name.split('/')[0]}/, a prefix of rlite's "
                                 "own metrics; report it under a prefix of your own ('myengine/...')")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"MetricsSink.report: metric {name!r} must be a real number, got {value!r:.80}")
            checked[name] = float(value)
        with self._lock:
            for name, value in checked.items():
                self._add(name, reduce, value, 1)

    def merge(self, reported: Reported) -> None:
        """Add what another sink drained (another process's, received over :mod:`rlite.sync`)."""
        with self._lock:
            for name, (reduce, total, reports) in reported.items():
                self._add(name, reduce, float(total), int(reports))

    def drain(self) -> Reported:
        """Everything reported since the last drain, and forget it."""
        with self._lock:
            drained, self._pending = self._pending, {}
        return drained

    def _add(self, name: str, reduce: str, total: float, reports: int) -> None:
        held = self._pending.get(name)
        if held is not None and held[0] != reduce:
            raise ValueError(f"metric {name!r} is reported with reduce={reduce!r} and with reduce={held[0]!r}; "
                             "give each name one")
        self._pending[name] = (reduce, total + (held[1] if held else 0.0), reports + (held[2] if held else 0))


def drained(component: Any) -> Reported:
    """What ``component`` reported through its ``metrics`` attribute (a :class:`MetricsSink`), drained; ``{}``
    for a component without one."""
    sink = getattr(component, "metrics", None)
    return sink.drain() if isinstance(sink, MetricsSink) else {}


def merge_reported(parts: Iterable[Reported]) -> Reported:
    """Several drained reports (of ranks, of calls) as one."""
    sink = MetricsSink()
    for part in parts:
        sink.merge(part)
    return sink.drain()


def reported_values(reported: Reported) -> dict[str, float]:
    """The row's values of a (merged) report: each ``sum`` name's total, each ``mean`` name's mean over its
    reports."""
    return {name: total if reduce == "sum" else total / max(reports, 1)
            for name, (reduce, total, reports) in sorted(reported.items())}


# --------------------------------------------------------------------------------------------------
# loggers
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class Logger(Protocol):
    """What a logger (``register_loggers``, listed in ``logging.loggers``) is: its factory
    ``factory(run_dir, config, cfg)`` returns one (or None when it cannot run, say its package is missing:
    the run goes on without it and says so). Loggers are built on rank 0 only and called there.

    ``log`` and ``close`` are required; ``log_samples`` and ``resume`` are optional, and the defaults below
    (do nothing) are what a logger without them gets. rlite's own loggers (``jsonl``, ``tensorboard``,
    ``wandb``; ``rlite.plugins.loggers``) implement this class."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The metrics row of ``step``: flat ``name -> value`` (``reward/mean``, ``actor/pg_loss``; a value may
        be NaN or infinite). Step 0 is a fresh run's baseline evaluation. Called once per step, in step order,
        after the step's evaluation and before its checkpoint is saved."""

    def close(self) -> None:
        """Flush and release what the logger holds; called once at the end of the run, also when it stops on
        an error."""

    def log_samples(self, step: int, kind: str, rows: list[dict]) -> None:
        """Some of the step's rollouts: ``kind`` is ``train`` or ``eval``, ``rows`` as in ``samples.jsonl``
        (:mod:`rlite.samples`: prompt, completion, reward, ...). Every ``logging.samples_every`` steps."""

    def resume(self, step: int) -> None:
        """The run resumes from a checkpoint of ``step``: called once, before anything is logged. Forget (or
        hide) what an interrupted run logged after ``step``, so that each step shows once."""


class ProgressBar:
    """On a terminal, a rich progress bar: step, reward, accuracy, tokens/s, ETA. When stdout is not a
    terminal (a pipe, ``nohup``, a cluster scheduler's log file), a plain line at the run's first step,
    every ``plain_every`` steps and at the last step instead, with no escape codes (:func:`plain_progress_line`). Silent
    when disabled."""

    def __init__(self, total: int, start: int, enabled: bool, plain_every: int = 10, stream=None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        self.plain = enabled and not self.stream.isatty()
        self.total, self.start, self.plain_every = total, start, max(int(plain_every), 1)
        self.started = time.perf_counter()
        self.last_accuracy: float | None = None
        if not enabled or self.plain:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]rlite"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}  acc {task.fields[acc]}{task.fields[spec]}  {task.fields[tps]} tok/s"
                       "{task.fields[mfu]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, reward="-", acc="-", spec="", tps="-",
                                           mfu="")
        self.progress.start()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if "eval/greedy_accuracy" in metrics:
            self.last_accuracy = metrics["eval/greedy_accuracy"]
        if self.plain:
            if step % self.plain_every == 0 or step in (self.start + 1, self.total):  # the first: it is alive
                elapsed = time.perf_counter() - self.started
                line = plain_progress_line(step, self.total, self.start, elapsed, metrics, self.last_accuracy)
                print(line, file=self.stream, flush=True)
            return
        fields = {}
        if "reward/mean" in metrics:
            fields["reward"] = f"{metrics['reward/mean']:.3f}"
        if "eval/greedy_accuracy" in metrics:
            fields["acc"] = f"{metrics['eval/greedy_accuracy']:.3f}"
        if "spec/acceptance_rate" in metrics:
            fields["spec"] = f"  draft accept {metrics['spec/acceptance_rate']:.2f}"
        if "perf/tokens_per_s" in metrics:
            fields["tps"] = f"{metrics['perf/tokens_per_s']:.0f}"
        if "perf/mfu" in metrics:
            fields["mfu"] = f"  MFU {metrics['perf/mfu']:.1%}"
        self.progress.update(self.task, completed=step, **fields)

    def close(self) -> None:
        if self.enabled and not self.plain:
            self.progress.stop()


ZERO_VARIANCE_KEY = "advantage/zero_variance_groups"
"""The fraction of the step's groups whose samples all got the same reward: their GRPO-style
advantages are all zero, so they teach the policy nothing."""
NO_SIGNAL_FRACTION = 0.9
"""A step with at least this fraction of zero-variance groups counts as one without a learning signal."""


class LearningSignalWatch:
    """Warns (rank 0, on stderr through ``logging``) when most groups have no reward variance step
    after step: the progress line then shows a flat reward and nothing says why the run does not learn.
    The loop enables it for group-relative advantage estimators (grpo, rloo, ...: registered with
    ``needs_group``), whose advantages such groups zero.

    The first warning comes after ``after_steps`` such steps in a row; later ones at most every
    ``every_steps`` steps while it lasts. Each names the likely cause, read off the step's metrics."""

    def __init__(self, enabled: bool = True, after_steps: int = 5, every_steps: int = 50) -> None:
        self.enabled, self.after_steps, self.every_steps = enabled, after_steps, every_steps
        self.steps_in_a_row = 0
        self.last_warned: int | None = None

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """Count this step; the warning logged, if one is due."""
        fraction = metrics.get(ZERO_VARIANCE_KEY)
        if not self.enabled or fraction is None:
            return None
        if fraction < NO_SIGNAL_FRACTION:
            self.steps_in_a_row = 0
            return None
        self.steps_in_a_row += 1
        if self.steps_in_a_row < self.after_steps:
            return None
        if self.last_warned is not None and step - self.last_warned < self.every_steps:
            return None
        self.last_warned = step
        message = no_learning_signal_message(self.steps_in_a_row, metrics)
        log.warning(message)
        return message


def no_learning_signal_message(steps: int, metrics: dict[str, float]) -> str:
    """What :class:`LearningSignalWatch` says: what is wrong, the likely cause, and what to watch."""
    fraction = metrics[ZERO_VARIANCE_KEY]
    mean, accuracy = metrics.get("reward/mean", float("nan")), metrics.get("reward/accuracy")
    head = (f"no learning signal for {steps} steps in a row: in {fraction:.0%} of the groups every sample got the "
            f"same reward (this step's reward mean {mean:.3f}), so their advantages are all zero and the update "
            "learns nothing from them.")  # fmt: skip
    if metrics.get("reward/std", 1.0) == 0.0 and not accuracy:
        cause = ("No sample earned a reward: check that the reward function fires on a right answer and that the "
                 "answer column (data.answer_key) holds what it compares with; samples.jsonl shows what the model "
                 "was given (prompt_text) and what it wrote.")  # fmt: skip
    elif accuracy is not None and accuracy >= 0.99:
        cause = "Every sample is right: the prompts are too easy for this model; give it harder ones."
    else:
        cause = ("The samples of each prompt score alike: rollout.temperature may be too low for them to differ "
                 "(or rollout.samples_per_prompt too small), or each prompt is too easy (all right) or too hard "
                 "(all wrong) for this model.")  # fmt: skip
    return f"{head} {cause} Watch {ZERO_VARIANCE_KEY} in metrics.jsonl (the share of such groups)."


def format_duration(seconds: float) -> str:
    """``H:MM:SS``."""
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def plain_progress_line(step: int, total: int, start: int, elapsed: float, metrics: dict[str, float],
                        accuracy: float | None) -> str:
    """``step 10/500 | reward 0.312 | eval acc 0.450 | 1234 tok/s | 0.35 s/step | elapsed 0:00:04 | eta 0:02:53``:
    the reward of this step, the latest greedy held-out accuracy, and the ETA from this run's mean step time;
    with a speculative draft its acceptance rate (``draft accept 0.78``), when most groups had equal
    rewards their share (``no signal in 100% of groups``), and with a known device peak the trainer's
    model FLOPs utilisation (``MFU 31.2%``, :mod:`rlite.perf`)."""
    done = max(step - start, 1)
    per_step = elapsed / done
    parts = [f"step {step}/{total}"]
    if "reward/mean" in metrics:
        parts.append(f"reward {metrics['reward/mean']:.3f}")
    if accuracy is not None:
        parts.append(f"eval acc {accuracy:.3f}")
    if metrics.get(ZERO_VARIANCE_KEY, 0.0) >= NO_SIGNAL_FRACTION:
        parts.append(f"no signal in {metrics[ZERO_VARIANCE_KEY]:.0%} of groups")
    if "spec/acceptance_rate" in metrics:
        parts.append(f"draft accept {metrics['spec/acceptance_rate']:.2f}")
    if "perf/tokens_per_s" in metrics:
        parts.append(f"{metrics['perf/tokens_per_s']:.0f} tok/s")
    if "perf/mfu" in metrics:
        parts.append(f"MFU {metrics['perf/mfu']:.1%}")
    parts += [f"{per_step:.2f} s/step", f"elapsed {format_duration(elapsed)}",
              f"eta {format_duration(per_step * (total - step))}"]  # fmt: skip
    return " | ".join(parts)


def read_log_rows(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, row)`` for each row of a JSON-lines log (``metrics.jsonl``, ``samples.jsonl``: every row an
    object with a ``step``), read as a crash may have left it.

    A crash or a full disk mid-write leaves the last line cut short, and some file systems leave NUL bytes
    after the end of a file that was being appended to: both are dropped with a warning naming the file and
    line. A line that is not a row anywhere else is not what a crash leaves (the file was edited or
    damaged): :class:`~rlite.config.ConfigError` naming the file and line, rather than drop history.
    """
    from rlite.config import ConfigError
    from rlite.run_files import RunFolderError, read_run_file

    path = Path(path)
    raw = read_run_file(path)  # never through a link (rlite.run_files)
    body = raw.rstrip(b"\x00\r\n\t ")
    lines = body.decode("utf-8", errors="replace").split("\n")
    first = next((line for line in lines if line.strip()), None)
    if first is not None and _row_problem(first):
        # a file rlite did not write (a one-line key file, a copy of something else): nothing of it is dropped or
        # echoed, since a crash leaves the first row whole long before a checkpoint exists to resume
        raise RunFolderError(
            f"{path}: its first line is not a row rlite writes (a JSON object with a step), so it is no rlite log: rlite "
            "neither repairs nor rewrites it. Move it out of the run folder, or point logging.run_dir elsewhere"
        )
    if b"\x00" in raw[len(body):]:
        log.warning("%s: dropped %d NUL bytes after its last line (what a crash during a write can leave)",
                    path, raw[len(body):].count(b"\x00"))
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        problem = _row_problem(line)
        if not problem:
            row = json.loads(line)
            rows.append((line, row))
        elif number == len(lines):
            log.warning("%s: dropped line %d, cut short by a crash or a full disk (%s): %.80r", path, number, problem, line)
        else:
            raise ConfigError(
                f"{path} line {number} is not a JSON row ({problem}) and is not the last line, so no crash left it "
                "there: the file was edited or damaged. Fix or delete that line and run again (or start afresh with "
                "checkpoint.resume=never, which replaces the file)"
            )
    return rows


def _row_problem(line: str) -> str:
    """Why ``line`` is not a row of an rlite log ("" when it is)."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        return str(exc)
    return "" if isinstance(row, dict) and "step" in row else "not an object with a step"


def trim_metrics_file(path: str | Path, keep_through_step: int | None) -> None:
    """Make ``metrics.jsonl`` describe this run only: a fresh run (``None``) starts it empty; a resumed
    run keeps the rows up to its checkpoint's step and drops rows logged after it before a crash (and a
    last line the crash cut short: :func:`read_log_rows`). The file is replaced, never rewritten in place,
    and a link or special file in its place is refused (:mod:`rlite.run_files`)."""
    from rlite.run_files import refuse_link_or_special, replace_run_file

    path = Path(path)
    refuse_link_or_special(path)
    if not path.is_file():
        return
    if keep_through_step is None:
        path.unlink()
        return
    kept = [line for line, row in read_log_rows(path) if row["step"] <= keep_through_step]
    replace_run_file(path, "".join(line + "\n" for line in kept))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's log -- ``metrics.jsonl`` (provenance rows, :mod:`rlite.run.provenance`, are skipped),
    ``samples.jsonl``, ``eval.jsonl`` -- as :func:`read_log_rows` reads them: rlite's one reader of its logs
    (the audit, ``rlite info``, the summary and the tests' ``rlite.testing.read_jsonl`` go through it)."""
    return [row for _, row in read_log_rows(path) if "provenance" not in row]


SMOOTHING = 0.9
"""Weight of the smoothed reward curve in ``plot.png`` (:func:`smooth`): about the last 10 steps."""


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's debiased exponential moving average: ``m_t = weight * m_{t-1} + (1 - weight) * x_t``
    from ``m_0 = 0``, reported as ``m_t / (1 - weight^t)`` so that the first points are not pulled
    towards 0."""
    out, mean = [], 0.0
    for t, value in enumerate(values, start=1):
        mean = weight * mean + (1 - weight) * value
        out.append(mean / (1 - weight**t))
    return out


PLOT_PANELS = {
    "reward": (("reward/mean", "train reward (sampled)"), ("eval/greedy_accuracy", "eval accuracy (greedy)"),
               ("eval/sampled_accuracy", "eval accuracy (sampled)")),
    "response length": (("response/length", "mean response length (tokens)"),),
    "entropy": (("actor/entropy", "policy entropy (nats/token)"),),
    "KL": (("actor/kl_loss", "KL to the reference (loss term)"), ("actor/reward_kl", "KL in the reward (penalised)"),
           ("mismatch/kl", "rollout vs trainer (mismatch)")),
}
"""The panels of ``plot.png``: title -> (metric, label) curves; a metric the run did not log is left out."""
SPECULATION_PANEL = {
    "speculative decoding": (("spec/acceptance_rate", "draft acceptance rate (accepted / proposed)"),
                             ("draft/top1_agreement", "draft top-1 agreement with the samples")),
}
"""A fifth panel, only for a run with a speculative draft (``rollout.draft``)."""


def plot_run(metrics_file: str | Path, out_png: str | Path) -> Path | None:
    """``plot.png``: four panels against step. Reward: the train reward, its smoothed curve
    (:func:`smooth`) and the held-out accuracies; response length; policy entropy; KL (to the reference
    and in the reward where the run has them, and between the engine's and the trainer's log-probs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_file)
    if not rows:
        return None
    fig = plot_figure(rows)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)


def plot_figure(rows: list[dict[str, Any]]):
    """The matplotlib figure of :func:`plot_run` from the metrics rows."""
    import matplotlib.pyplot as plt

    panels = dict(PLOT_PANELS)
    if any("spec/acceptance_rate" in r for r in rows):
        panels.update(SPECULATION_PANEL)
    grid_rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(grid_rows, 2, figsize=(11, 3.5 * grid_rows), sharex=True)
    for ax in axes.flat[len(panels):]:
        fig.delaxes(ax)
    for ax, (title, curves) in zip(axes.flat, panels.items()):
        for key, label in curves:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if not points:
                continue
            steps, values = zip(*points)
            evaluation = key.startswith("eval/")
            ax.plot(steps, values, label=label, marker="o" if evaluation else None,
                    alpha=0.35 if key == "reward/mean" else 0.9)  # fmt: skip
            if key == "reward/mean":
                ax.plot(steps, smooth(list(values)), label=f"train reward, smoothed (EMA {SMOOTHING})")
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in fig.axes[-2:]:
        ax.set_xlabel("step")
        ax.xaxis.set_tick_params(labelbottom=True)  # the panel above a removed one has the last row's axis
    fig.tight_layout()
    return fig


def print_summary(summary: dict[str, Any], breakdown: dict[str, float]) -> None:
    """The one-screen end-of-run summary, including where the time went."""
    import os

    from rich.console import Console
    from rich.table import Table

    # piped output (log files) is not cut at rich's default of 80 columns, so paths stay whole
    console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
    table = Table(title="rlite run summary", show_header=False)
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:.1%}" if key.startswith("mfu (") else f"{value:.4f}"  # a fraction of the device's peak
        table.add_row(key, str(value))
    console.print(table)
    times = Table(title="time breakdown")
    times.add_column("phase")
    times.add_column("seconds", justify="right")
    times.add_column("share", justify="right")
    for name, seconds, share in breakdown_rows(breakdown):
        times.add_row(name, f"{seconds:.2f}", f"{100 * share:.1f}%")
    console.print(times)
    line = f"rlite: {summary.get('steps', '?')} steps done in {summary.get('wall_time', '?')} wall"
    if "exported_model" in summary:
        line += f"; model exported to {summary['exported_model']}"
        if "run_dir" in summary:  # it expects prompts templated as in training: the command does that
            line += f" (talk to it: rlite chat {summary['run_dir']})"
    print(line, flush=True)


def breakdown_rows(breakdown: dict[str, float]) -> list[tuple[str, float, float]]:
    """``(label, seconds, share of the run)`` rows: phases by time, each followed by its parts
    (``train/backward`` as ``  backward``), which are not counted twice in the total."""
    top = {k: v for k, v in breakdown.items() if "/" not in k}
    total = sum(top.values()) or 1.0
    rows = []
    for name, seconds in sorted(top.items(), key=lambda kv: -kv[1]):
        rows.append((name, seconds, seconds / total))
        parts = {k: v for k, v in breakdown.items() if k.startswith(name + "/")}
        for part, part_seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
            rows.append(("  " + part[len(name) + 1 :], part_seconds, part_seconds / total))
    return rows


class StepProfiler:
    """``logging.profile``: a torch profiler trace of two steps (the 2nd and 3rd of this run), written
    to ``<run_dir>/profile/trace_rank<r>.json`` (Chrome trace format) with a table of the top
    operators in ``ops_rank<r>.txt``."""

    def __init__(self, enabled: bool, first_step: int, run_dir: Path, rank: int) -> None:
        self.enabled = enabled
        self.window = (first_step + 2, first_step + 3)
        self.out = Path(run_dir) / "profile"
        self.rank = rank
        self.profiler = None

    def before_step(self, step: int) -> None:
        if self.enabled and step == self.window[0]:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            import torch

            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self.profiler = profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()

    def after_step(self, step: int) -> None:
        if self.profiler is not None and step == self.window[1]:
            self.close()

    def close(self) -> None:
        if self.profiler is None:
            return
        self.profiler.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.out / f"trace_rank{self.rank}.json"))
        table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        (self.out / f"ops_rank{self.rank}.txt").write_text(table)
        self.profiler = None
