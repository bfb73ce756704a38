"""What a run works with: :class:`Run`, built once by :func:`rlite.run.build.build_run`.

Its own module, below both the builder and :mod:`rlite.run.lifecycle` (resume, the end of a run), which take a
``Run`` and must not import the builder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlite.config import RunConfig
from rlite.distributed import DistContext
from rlite.drafts import SpeculativeDraft
from rlite.engines.base import RolloutEngine
from rlite.plugin_manager import RlitePluginManager
from rlite.run.checkpointer import Checkpointer
from rlite.run.faults import Preemption
from rlite.run.policy import Policy
from rlite.run.recorder import Recorder
from rlite.stages.collect import Rollouts
from rlite.stages.evaluate import Evaluation
from rlite.stages.sync import WeightSync
from rlite.stages.targets import Targets


@dataclass(frozen=True)
class Run:
    """Everything ``train()`` works with, built once by :func:`~rlite.run.build.build_run`: the run's identity,
    and its components, each built by its own builder and owning what changes in it during the run."""

    config: RunConfig
    ctx: DistContext
    pm: RlitePluginManager
    run_dir: Path
    tokenizer: Any  # a transformers tokenizer
    start_step: int
    """The step the run resumed from (0: a fresh run)."""
    resumed_from: Path | None
    """The checkpoint the run resumed from (``None``: a fresh run)."""
    preemption: Preemption
    """The preemption signals' flag (:func:`rlite.run.loop.run_training` installs its handlers)."""
    engine: RolloutEngine
    draft: SpeculativeDraft | None
    """The speculative-decoding draft (``rollout.draft``; ``None``: plain decoding)."""
    rollouts: Rollouts
    """Stages 1-2: sampling and scoring each step's batch."""
    targets: Targets
    """Stage 3: pi_old, pi_ref, the KL penalty, corrections, advantages."""
    policy: Policy
    """Stage 4: the trained models and their update."""
    weight_sync: WeightSync
    """Stage 6: what travels to the engine."""
    evaluation: Evaluation
    """The held-out evaluation."""
    recorder: Recorder
    """The metric rows, samples, timer and progress line."""
    checkpointer: Checkpointer
    """The checkpoints, and the step in progress a stop saves."""
