"""``thirdparty_fsdp2``: the registered ``fsdp2`` backend, wrapped; it counts optimizer steps.

The wrapper implements the one method it changes (``step``) and hands every other member of the
``rlite.api.TrainingBackend`` contract (log-probs, backward, weights, checkpoints, reference, critic, ...)
to the inner backend. Its counts reach the step's metrics row through its ``metrics`` attribute, an
``rlite.api.MetricsSink`` the loop drains after the update: ``thirdparty/n_backend_steps`` and
``thirdparty/n_backend_skipped_steps``, this step's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlite.api import MetricsSink, registered


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
        # the inner backend's own sink if it has one (its reports and ours reach the row together), else ours
        inner_sink = getattr(inner, "metrics", None)
        self.metrics = inner_sink if isinstance(inner_sink, MetricsSink) else MetricsSink()

    def step(self, before_step=None, *, skip: bool = False) -> float:
        skipped = getattr(self.inner, "skipped_steps", 0)
        norm = self.inner.step(before_step, skip=skip)
        self.metrics.report({"thirdparty/n_backend_steps": 1,
                             "thirdparty/n_backend_skipped_steps": getattr(self.inner, "skipped_steps", 0) - skipped},
                            reduce="sum")
        return norm

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def make_thirdparty_backend(config, cfg: ThirdPartyBackendConfig, device, total_optimizer_steps):
    inner = registered("training_backend", cfg.inner)
    return CountingBackend(inner.implementation(config, cfg.inner_args, device, total_optimizer_steps))
