"""What a run works with: :class:`Run`, built once by :func:`rlite.run.build.build_run`.

Its own module, below both the builder and :mod:`rlite.run.lifecycle` (checkpoints, resume, the end
of a run), which take a ``Run`` and must not import the builder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlite.config import RunConfig
from rlite.data import PromptSampler, PromptSet
from rlite.distributed import DataLayout, DistContext
from rlite.drafts import SpeculativeDraft
from rlite.engines.base import RolloutEngine
from rlite.kl_control import KLController
from rlite.metrics import StepTimer
from rlite.plugin_manager import RlitePluginManager
from rlite.run.faults import Preemption
from rlite.samples import SampleWriter
from rlite.stages.collect import Rollouts
from rlite.stages.evaluate import Evaluation
from rlite.stages.routing import RoutingSetup
from rlite.stages.sync import Quantizer, sync_weights_to_engine
from rlite.stages.targets import TargetsSpec
from rlite.stages.update import LossSpec
from rlite.training.backend import CriticModel, ForwardSpec, ScoringModel, TrainingBackend


@dataclass
class Run:
    """Everything ``train()`` works with, built once by :func:`build_run`."""

    config: RunConfig
    ctx: DistContext
    layout: DataLayout
    """The data-parallel shard of this rank (from the backend)."""
    pm: RlitePluginManager
    run_dir: Path
    tokenizer: Any  # a transformers tokenizer
    eval_prompts: PromptSet | None
    sampler: PromptSampler
    rollouts: Rollouts
    """Sampling and scoring each step's batch."""
    evaluation: Evaluation
    """The held-out evaluation."""
    backend: TrainingBackend
    reference: ScoringModel | None
    critic: CriticModel | None
    engine: RolloutEngine
    forward: ForwardSpec
    loss: LossSpec
    targets: TargetsSpec
    quantizer: Quantizer | None
    kl_controller: KLController
    loggers: list = field(default_factory=list)
    timer: StepTimer = field(default_factory=StepTimer)
    start_step: int = 0
    routing: RoutingSetup | None = None
    """MoE routing replay and metrics (``None``: a dense model, or both off)."""
    draft: SpeculativeDraft | None = None
    """The speculative-decoding draft (``rollout.draft``; ``None``: plain decoding)."""
    started: float = field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when the run started being built (the summary's wall time counts from it)."""
    samples: SampleWriter | None = None
    """Where rollouts are written for people to read (rank 0 with ``logging.samples_every``; else ``None``)."""
    in_progress: tuple[int, dict | None] = (0, None)
    """The step under way and, until its policy update, the state it started from
    (:func:`rlite.run.lifecycle.step_start_state`); ``None`` once the policy has moved."""
    unlogged_metrics: dict | None = None
    """The metrics of the step in progress once its policy has moved, until its row is logged: a stop before
    then (an engine dead past its restarts) logs them before it saves that step's checkpoint."""
    preemption: Preemption = field(default_factory=lambda: Preemption(0.0))
    """The preemption signals' flag (:func:`rlite.loop.run_training` installs its handlers)."""
    provenance: dict = field(default_factory=dict)
    """What produced this run (:mod:`rlite.provenance`), written into every checkpoint."""
    resumed_from: Path | None = None
    """The checkpoint the run resumed from (``None``: a fresh run)."""

    def sync_weights(self, version: int) -> None:
        sync_weights_to_engine(
            self.engine, self.backend, lora_sync=self.config.rollout.lora_sync, quantizer=self.quantizer,
            version=version, draft=self.draft,
        )
