"""The learning-rate schedule every backend uses: linear warmup, then constant, cosine or linear decay
to ``min_lr_ratio``."""

from __future__ import annotations

import math

import torch

from rlite.config import TrainingConfig


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """LR multiplier before optimizer step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return min_ratio + (1 - min_ratio) * (1 - progress)  # linear


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, train_cfg: TrainingConfig, total_optimizer_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``training.lr`` times :func:`lr_factor` of the optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(
            s,
            warmup=train_cfg.warmup_steps,
            total=total_optimizer_steps,
            schedule=train_cfg.lr_schedule,
            min_ratio=train_cfg.min_lr_ratio,
        ),
    )
