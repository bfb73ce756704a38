"""``thirdparty_fsdp2``: the registered ``fsdp2`` backend, wrapped; it counts optimizer steps.

The wrapper implements the one method it changes (``step``) and hands every other member of the
``rlite.api.TrainingBackend`` contract (log-probs, backward, weights, checkpoints, reference, critic, ...)
to the inner backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlite.api import registered
from rlite_thirdparty_kit.engines import COUNTS


@dataclass
class ThirdPartyBackendConfig:
    inner: str = field(default="fsdp2", metadata={"choice_of": "training_backend"})
    """The registered backend to wrap."""
    inner_args: Any = None
    """The wrapped backend's options (a mapping in YAML); they arrive as its config instance."""


class CountingBackend:
    """A training backend that counts the optimizer steps it takes (skipped ones separately)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def step(self, before_step=None, *, skip: bool = False) -> float:
        skipped = getattr(self.inner, "skipped_steps", 0)
        norm = self.inner.step(before_step, skip=skip)
        COUNTS["backend_steps"] += 1
        COUNTS["backend_skipped_steps"] += getattr(self.inner, "skipped_steps", 0) - skipped
        return norm

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def make_thirdparty_backend(config, cfg: ThirdPartyBackendConfig, device, total_optimizer_steps):
    inner = registered("training_backend", cfg.inner)
    return CountingBackend(inner.implementation(config, cfg.inner_args, device, total_optimizer_steps))
