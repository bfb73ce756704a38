"""``thirdparty_fsdp2``: the registered ``fsdp2`` backend, wrapped; it counts optimizer steps.

The wrapper is an ``rlite.api.BackendWrapper``: it implements the one method it changes (``step``) and the
base class hands every other member of the ``rlite.api.TrainingBackend`` contract (log-probs, backward,
weights, checkpoints, reference, critic, ...) to the inner backend."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlite.api import BackendWrapper, registered
from rlite_thirdparty_kit.engines import COUNTS


@dataclass
class ThirdPartyBackendConfig:
    inner: str = field(default="fsdp2", metadata={"choice_of": "training_backend"})
    """The registered backend to wrap."""
    inner_args: dict = field(default_factory=dict)
    """The wrapped backend's options."""


class CountingBackend(BackendWrapper):
    """A training backend that counts the optimizer steps it takes (skipped ones separately)."""

    def step(self, before_step=None, *, skip: bool = False) -> float:
        skipped = self.skipped_steps
        norm = super().step(before_step, skip=skip)
        COUNTS["backend_steps"] += 1
        COUNTS["backend_skipped_steps"] += self.skipped_steps - skipped
        return norm


def make_thirdparty_backend(config, cfg: ThirdPartyBackendConfig, device, total_optimizer_steps):
    inner = registered("training_backend", cfg.inner)
    inner_cfg = inner.config_cls(**cfg.inner_args) if inner.config_cls is not None else None
    return CountingBackend(inner.implementation(config, inner_cfg, device, total_optimizer_steps))
