"""Built-in training backend: ``fsdp2`` (PyTorch FSDP2 ``fully_shard``; see ``rlite.actor``).

Megatron (for MoE with expert parallelism) is meant to come as a separate plugin registering
another backend through the same hook.
"""

from __future__ import annotations

from rlite import hookimpl


def make_fsdp2(config, cfg, device, total_optimizer_steps):
    from rlite.actor import FSDP2Backend

    return FSDP2Backend.build(config.model, config.parallelism, config.training, device, total_optimizer_steps)


@hookimpl
def register_training_backends(register):
    register("fsdp2", make_fsdp2)
