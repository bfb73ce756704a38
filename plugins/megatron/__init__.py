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


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def megatron_trainer_memory(config, cfg: MegatronConfig, parameters: int, world_size: int) -> dict[str, int]:
    """One rank's trainer state, for the memory check run before a run allocates (``rlite.run.limits``,
    docs/memory.md). Unlike FSDP2's shards, every data-parallel rank holds a whole replica of its
    tensor-parallel slice: the model in ``parallelism.param_dtype``, float32 masters where ``model.dtype``
    differs from it, gradients in ``reduce_dtype`` where that differs (megatron's main_grad) and AdamW's two
    moments in ``model.dtype``; ZeRO-1 splits masters and moments over the data-parallel ranks. Experts are
    counted as if every parameter were split over tensor x expert parallel ranks, so the estimate errs low,
    as the rest of the check does (a refused run would not have fit)."""
    n = -(-parameters // (cfg.tensor_parallel * cfg.expert_parallel))
    data_parallel = max(1, world_size // cfg.tensor_parallel)
    zero = data_parallel if cfg.distributed_optimizer else 1
    model_b = DTYPE_BYTES[config.model.dtype]
    param_b = DTYPE_BYTES[config.parallelism.param_dtype]
    reduce_b = DTYPE_BYTES[config.parallelism.reduce_dtype]
    return {
        "weights": n * param_b,
        "master weights": -(-n * model_b // zero) if config.model.dtype != config.parallelism.param_dtype else 0,
        "gradients": n * (reduce_b if config.parallelism.reduce_dtype != config.parallelism.param_dtype else param_b),
        "AdamW moments": -(-2 * n * model_b // zero) if config.training.optimizer_offload == "none" else 0,
        "reference model": n * param_b if config.algorithm.kl.coef != 0 else 0,
    }


@hookimpl
def register_training_backends(register):
    register("megatron", make_megatron, MegatronConfig, trainer_memory=megatron_trainer_memory)
