"""Rollouts for people to read: what the model wrote, what it scored, and what it was pushed towards.

Every ``logging.samples_every`` steps rank 0 writes the first ``logging.samples_per_step`` rollouts of
its batch (groups are contiguous rows, so whole groups come first) to ``<run_dir>/samples.jsonl``, one
JSON object per rollout, and hands the same rows to every logger that has a ``log_samples`` method
(TensorBoard: a text table per step; wandb: a table). Every evaluation writes its generations too
(the first ``samples_per_step`` held-out prompts, greedy and sampled).

A row of a training step::

    {"step": 10, "kind": "train", "group": 3, "prompt": "12+30=",
     "prompt_text": "<|im_start|>user\\n12+30=<|im_end|>\\n<|im_start|>assistant\\n", "answer": "42",
     "completion": "42", "reward": 1.0, "rewards": {"exact_match": 1.0},
     "advantage": 0.87, "response_length": 3, "finish_reason": "stop"}

``prompt`` and ``answer`` are the data row's (a chat prompt stays a list of messages); ``prompt_text``
is the exact text the model was given: the prompt after the chat template (``data.chat_template``,
on by default) with ``data.system_prompt`` (``rlite chat`` and ``rlite generate`` format prompts the
same way). ``reward`` is the weighted sum the trainer used and ``rewards`` each reward function's own
(unweighted) value;
``advantage`` is the mean of the sample's per-token advantages over its response tokens (the one
value of GRPO-style estimators). An evaluation's rows have ``"kind": "eval"``, a ``mode`` (greedy or
sampled) and no advantage. A resumed run drops the rows logged after its checkpoint, like
``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlite.rollout import ScoredBatch, TrainTargets


def _number(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def train_sample_rows(batch: ScoredBatch, targets: TrainTargets | None, step: int, count: int,
                      reward_names: list[str] | None = None, tokenizer=None) -> list[dict[str, Any]]:  # fmt: skip
    """The first ``count`` rollouts of a scored batch, with their ``targets`` (for each one's advantage), as
    rows; ``reward_names``: the reward functions, one per column of ``batch.reward_components``;
    ``tokenizer``: decodes each prompt's tokens into ``prompt_text`` (special tokens kept: the template's
    markers are part of it)."""
    rows = []
    lengths = batch.response_lengths
    for i in range(min(count, len(batch))):
        row: dict[str, Any] = {
            "step": step,
            "kind": "train",
            "group": int(batch.group_ids[i]),
            "prompt": batch.samples[i].get("prompt"),
        }
        if tokenizer is not None:
            row["prompt_text"] = tokenizer.decode(batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist())
        row |= {
            "answer": batch.samples[i].get("answer"),
            "completion": batch.completion_texts[i] if batch.completion_texts else None,
            "reward": _number(batch.scores[i]),
        }
        if reward_names:
            row["rewards"] = {k: _number(v) for k, v in zip(reward_names, batch.reward_components[i].tolist())}
        if targets is not None:
            mask = batch.response_mask[i]
            advantage = (targets.advantages[i] * mask).sum() / mask.sum().clamp(min=1)
            row["advantage"] = _number(advantage)
        row["response_length"] = int(lengths[i])
        row["finish_reason"] = batch.finish_reasons[i]
        rows.append(row)
    return rows


def eval_sample_rows(step: int, mode: str, items: list, texts: list[str], scores: list[float],
                     count: int) -> list[dict[str, Any]]:
    """An evaluation's first ``count`` generations (``items``: the held-out prompts) as rows."""
    return [
        {"step": step, "kind": "eval", "mode": mode, "prompt": item.row.get("prompt"),
         "prompt_text": item.prompt_text, "answer": item.row.get("answer"), "completion": text, "reward": _number(score)}
        for item, text, score in list(zip(items, texts, scores))[:count]
    ]  # fmt: skip


class SampleWriter:
    """Appends rows to ``samples.jsonl`` and passes them to the loggers that show samples."""

    def __init__(self, path: Path, loggers: list) -> None:
        self.path = Path(path)
        self.loggers = [logger for logger in loggers if callable(getattr(logger, "log_samples", None))]

    def write(self, step: int, kind: str, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        from rlite.run_files import open_run_file

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open_run_file(self.path, "a") as handle:  # never through a link (rlite.run_files)
            for row in rows:
                handle.write(json.dumps(row, default=str) + "\n")
        for logger in self.loggers:
            logger.log_samples(step, kind, rows)


def samples_markdown(rows: list[dict[str, Any]]) -> str:
    """A markdown table of sample rows (TensorBoard's text plugin renders it)."""
    columns = [c for c in ("group", "mode", "prompt", "prompt_text", "answer", "completion", "reward", "advantage", "rewards")
               if any(c in row for row in rows)]  # fmt: skip

    def cell(value: Any) -> str:
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif not isinstance(value, str):
            value = json.dumps(value, default=str)
        return value.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
