"""Where a run stands, read from its folder: what ``rlite info`` shows first, and the check that makes
re-running a finished run say so instead of running nothing silently.

Everything here reads files (``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, ``hf_model/``); no
model, engine or plugin loads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rlite.config import RunConfig

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def run_status(run_dir: str | Path) -> dict[str, Any]:
    """``steps_done``, ``steps_planned`` (``training.steps`` of the run's ``config.yaml``; None without
    one), ``last_reward`` (``reward/mean`` of the last step), ``eval_greedy_accuracy`` and
    ``eval_sampled_accuracy`` with ``eval_step`` (the last evaluation), ``time_in_steps_s`` (the sum of
    every step's ``time/step``: generation to checkpoint, without start-up and the step-0 evaluation),
    ``exported_model`` (``hf_model/`` when it exists) and ``latest_checkpoint``."""
    from rlite.metrics import read_log_rows
    from rlite.run.checkpoint import checkpoint_root, list_checkpoints

    run_dir = Path(run_dir)
    logged = [row for _, row in read_log_rows(run_dir / "metrics.jsonl")] if (run_dir / "metrics.jsonl").is_file() else []
    rows = [row for row in logged if "provenance" not in row]
    by_step = {int(row["step"]): row for row in rows if isinstance(row.get("step"), (int, float))}
    trained = [row for step, row in sorted(by_step.items()) if step > 0]
    evals = [row for _, row in sorted(by_step.items()) if row.get("eval/greedy_accuracy") is not None]
    checkpoints = list_checkpoints(checkpoint_root(run_dir))
    return {
        "steps_done": max(by_step, default=0),
        "steps_planned": planned_steps(run_dir),
        "last_reward": trained[-1].get("reward/mean") if trained else None,
        "eval_step": int(evals[-1]["step"]) if evals else None,
        "eval_greedy_accuracy": evals[-1].get("eval/greedy_accuracy") if evals else None,
        "eval_sampled_accuracy": evals[-1].get("eval/sampled_accuracy") if evals else None,
        "time_in_steps_s": sum(float(row.get("time/step", 0.0)) for row in trained) if trained else None,
        **wall_time(logged),
        "exported_model": str(run_dir / "hf_model") if (run_dir / "hf_model" / "config.json").is_file() else None,
        "latest_checkpoint": str(checkpoints[-1]) if checkpoints else None,
    }


def wall_time(logged: list[dict[str, Any]]) -> dict[str, Any]:
    """``wall_s``: the wall time of the commands that trained the run, start-up included, up to the last step
    each one logged (every ``rlite train`` that ran begins its rows with a provenance row; a row's
    ``perf/wall_s`` counts from when its command began); ``runs``: how many commands trained. None where the
    rows carry no ``perf/wall_s`` (written before rlite recorded it)."""
    segments: list[float | None] = []
    for row in logged:
        if "provenance" in row:
            segments.append(None)
        elif segments and "perf/wall_s" in row:
            segments[-1] = float(row["perf/wall_s"])
    walls = [wall for wall in segments if wall is not None]
    return {"wall_s": sum(walls) if walls else None, "runs": len(walls)}


def planned_steps(run_dir: Path) -> int | None:
    """``training.steps`` of the run's ``config.yaml`` (None when there is none or it has no such key)."""
    from omegaconf import OmegaConf

    from rlite.run_files import read_run_file

    try:  # through the run-folder reader: a link or a FIFO in place of config.yaml is refused, never followed
        steps = OmegaConf.select(OmegaConf.create(read_run_file(run_dir / "config.yaml").decode()), "training.steps")
    except Exception:  # noqa: BLE001 - a missing or unreadable config: the status just lacks the plan
        return None
    return int(steps) if isinstance(steps, int) else None


def describe_status(status: dict[str, Any]) -> list[str]:
    """The lines ``rlite info`` prints first."""
    from rlite.metrics import format_duration

    planned = status["steps_planned"]
    done = status["steps_done"]
    state = "" if planned is None else (" (finished)" if done >= planned else f" of {planned}")
    lines = [f"steps done: {done}{state}"]
    if status["last_reward"] is not None:
        lines.append(f"last reward (reward/mean of step {done}): {status['last_reward']:.4f}")
    if status["eval_step"] is not None:
        sampled = status["eval_sampled_accuracy"]
        lines.append(f"held-out accuracy at step {status['eval_step']}: greedy {status['eval_greedy_accuracy']:.4f}"
                     + (f", sampled {sampled:.4f}" if sampled is not None else ""))
    if status.get("wall_s") is not None:
        runs = status["runs"]
        lines.append(f"wall time: {format_duration(status['wall_s'])} (start-up to the last step logged, "
                     f"{runs} run{'s' if runs != 1 else ''} of rlite train)")
    if status["time_in_steps_s"] is not None:
        lines.append(f"time in training steps: {format_duration(status['time_in_steps_s'])} "
                     "(the steps' time/step summed; start-up and the step-0 evaluation not counted)")
    if status["exported_model"]:
        lines.append(f"model: {status['exported_model']} (a Hugging Face folder; rlite chat RUN_DIR talks to it)")
    if status["latest_checkpoint"]:
        lines.append(f"latest checkpoint: {status['latest_checkpoint']}")
    if not status["exported_model"] and not status["latest_checkpoint"]:
        lines.append("model: none saved yet (no hf_model/, no checkpoint)")
    return lines


def finished_checkpoint(cfg: RunConfig) -> Path | None:
    """The checkpoint of the last step when re-running ``cfg`` would train nothing: ``checkpoint.resume=auto``
    finds a checkpoint at ``training.steps`` or later and the run exported its model (or does not export).
    Only the folder names are read; the resume itself verifies the checkpoint as always."""
    from rlite.run.checkpoint import checkpoint_root, list_checkpoints

    if cfg.checkpoint.resume != "auto":
        return None
    checkpoints = list_checkpoints(checkpoint_root(cfg.logging.run_dir))
    if not checkpoints or int(_STEP_DIR.match(checkpoints[-1].name).group(1)) < cfg.training.steps:
        return None
    if cfg.checkpoint.export_hf and not (Path(cfg.logging.run_dir) / "hf_model" / "config.json").is_file():
        return None  # the export did not happen: the resume exports it
    return checkpoints[-1]
