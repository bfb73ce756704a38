"""Step timing, the live progress bar, the final plot and the one-screen summary (rank 0)."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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


class ProgressBar:
    """A rich progress bar: step, reward, accuracy, tokens/s, ETA. Silent when disabled."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]rlite"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}  acc {task.fields[acc]}  {task.fields[tps]} tok/s"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, reward="-", acc="-", tps="-")
        self.progress.start()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        fields = {}
        if "reward/mean" in metrics:
            fields["reward"] = f"{metrics['reward/mean']:.3f}"
        if "eval/greedy_accuracy" in metrics:
            fields["acc"] = f"{metrics['eval/greedy_accuracy']:.3f}"
        if "perf/tokens_per_s" in metrics:
            fields["tps"] = f"{metrics['perf/tokens_per_s']:.0f}"
        self.progress.update(self.task, completed=step, **fields)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()


def trim_metrics_file(path: str | Path, keep_through_step: int | None) -> None:
    """Make ``metrics.jsonl`` describe this run only: a fresh run (``None``) starts it empty; a resumed
    run keeps the rows up to its checkpoint's step and drops rows logged after it before a crash."""
    path = Path(path)
    if not path.is_file():
        return
    if keep_through_step is None:
        path.unlink()
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= keep_through_step]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The metric rows of ``metrics.jsonl`` (provenance rows, :mod:`rlite.provenance`, are skipped)."""
    rows = []
    with open(path) as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                if "provenance" not in row:
                    rows.append(row)
    return rows


def plot_run(metrics_file: str | Path, out_png: str | Path) -> Path | None:
    """Reward and held-out accuracy against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_file)
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows if "reward/mean" in r]
    ax.plot(steps, [r["reward/mean"] for r in rows if "reward/mean" in r], label="train reward (sampled)", alpha=0.7)
    for key, label in (("eval/greedy_accuracy", "eval accuracy (greedy)"), ("eval/sampled_accuracy", "eval accuracy (sampled)")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)


def print_summary(summary: dict[str, Any], breakdown: dict[str, float]) -> None:
    """The one-screen end-of-run summary, including where the time went."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="rlite run summary", show_header=False)
    for key, value in summary.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)
    times = Table(title="time breakdown")
    times.add_column("phase")
    times.add_column("seconds", justify="right")
    times.add_column("share", justify="right")
    for name, seconds, share in breakdown_rows(breakdown):
        times.add_row(name, f"{seconds:.2f}", f"{100 * share:.1f}%")
    console.print(times)


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
