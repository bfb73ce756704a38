"""The ``megatron`` training backend: megatron-core ``GPTModel`` with tensor and expert parallelism,
for Mixture-of-Experts models (``pip install 'rlite[megatron]'``).

Registered through the ``rlite`` entry-point group exactly like a third-party plugin, and imports
only :mod:`rlite.api` and its own modules. ``parallelism.backend: megatron`` in any recipe switches a
run to it; everything else (data, rewards, algorithms, corrections, weight sync, engines,
checkpoints, metrics) stays the same. See ``docs/megatron.md``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from rlite.api import ConfigError, hookimpl


def megatron_installed() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


@dataclass
class MegatronConfig:
    tensor_parallel: int = 1
    """Tensor-parallel size (attention heads, MLP and vocabulary split over this many ranks)."""
    expert_parallel: int = 1
    """Expert-parallel size (each rank holds num_experts / expert_parallel experts)."""
    distributed_optimizer: bool = False
    """ZeRO-1, megatron's "distributed optimizer": each data-parallel rank keeps AdamW's moments (and the master
    weights under ``parallelism.param_dtype=bfloat16``) for its own slice of every parameter only, steps that
    slice and all-gathers the result (experts are split over their expert-data-parallel ranks). With one
    data-parallel rank there is nothing to split and it changes nothing."""

    def __post_init__(self) -> None:
        if not isinstance(self.distributed_optimizer, bool):
            raise ConfigError(
                f"parallelism.backend.args.distributed_optimizer must be true or false, got {self.distributed_optimizer!r}"
            )
        if self.tensor_parallel < 1 or self.expert_parallel < 1:
            raise ConfigError("parallelism.backend.args: tensor_parallel and expert_parallel must be >= 1")
        if not megatron_installed():
            raise ConfigError(
                "parallelism.backend=megatron needs megatron-core, which is not installed: "
                "pip install 'rlite[megatron]' (megatron-core 0.16.1 on Python 3.11, newer on 3.12+)"
            )


def make_megatron(config, cfg: MegatronConfig, device, total_optimizer_steps: int):
    from rlite.plugins.megatron.backend import MegatronBackend

    return MegatronBackend(config, cfg, device, total_optimizer_steps)


@hookimpl
def register_training_backends(register):
    register("megatron", make_megatron, MegatronConfig)
