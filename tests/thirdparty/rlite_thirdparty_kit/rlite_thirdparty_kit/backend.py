"""``thirdparty_fsdp2``: the registered ``fsdp2`` backend, wrapped; it counts optimizer steps.

The wrapper is an ``rlite.api.BackendWrapper``: it implements the one method it changes (``step``) and the
base class hands every other member of the ``rlite.api.TrainingBackend`` contract (log-probs, backward,
weights, checkpoints, reference, critic, ...) to the inner backend. Its counts reach the step's metrics row
through the wrapper's ``metrics`` (an ``rlite.api.MetricsSink``, the inner backend's if it has one), which the
loop drains after the update: ``thirdparty/n_backend_steps`` and ``thirdparty/n_backend_skipped_steps``,
this step's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlite.api import BackendWrapper, registered


@dataclass
class ThirdPartyBackendConfig:
    inner: str = field(default="fsdp2", metadata={"choice_of": "training_backend"})
    """The registered backend to wrap."""
    inner_args: Any = None
    """The wrapped backend's options (a mapping in YAML); they arrive as its config instance."""


class CountingBackend(BackendWrapper):
    """A training backend that counts the optimizer steps it takes (skipped ones separately)."""

    def step(self, before_step=None, *, skip: bool = False) -> float:
        skipped = self.skipped_steps
        norm = super().step(before_step, skip=skip)
        counts = {"thirdparty/n_backend_steps": 1, "thirdparty/n_backend_skipped_steps": self.skipped_steps - skipped}
        self.metrics.report(counts, reduce="sum")
        return norm


def make_thirdparty_backend(config, cfg: ThirdPartyBackendConfig, device, total_optimizer_steps):
    inner = registered("training_backend", cfg.inner)
    return CountingBackend(inner.implementation(config, cfg.inner_args, device, total_optimizer_steps))
