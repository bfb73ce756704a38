"""Built-in training backend: ``fsdp2`` (PyTorch FSDP2 ``fully_shard``; see ``rlite.backends.fsdp2``).

Megatron (for MoE with expert parallelism) is meant to come as a separate plugin registering
another backend through the same hook.
"""

from __future__ import annotations

from rlite.api import hookimpl


def make_fsdp2(config, cfg, device, total_optimizer_steps):
    import torch.distributed as dist

    from rlite.api import FSDP2Backend, optimizer_offload_dir

    offload_dir = None
    if config.training.optimizer_offload == "disk":
        rank = dist.get_rank() if dist.is_initialized() else 0
        offload_dir = optimizer_offload_dir(config.training.optimizer_offload_dir, config.logging.run_dir, rank)
    return FSDP2Backend.build(
        config.model, config.parallelism, config.training, device, total_optimizer_steps, offload_dir=offload_dir
    )


@hookimpl
def register_training_backends(register):
    register("fsdp2", make_fsdp2)
