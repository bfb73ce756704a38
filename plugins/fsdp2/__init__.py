"""The ``fsdp2`` training backend: PyTorch FSDP2 ``fully_shard`` over the decoder blocks of a Hugging Face model.

The backend is :mod:`rlite.plugins.fsdp2.backend` (the policy and reference models, AdamW, the schedule),
with :mod:`~rlite.plugins.fsdp2.critic` (PPO's value model), :mod:`~rlite.plugins.fsdp2.sharding` (sharding
and the sharded load), :mod:`~rlite.plugins.fsdp2.weights` (the stream of full tensors a weight sync and the
export read), :mod:`~rlite.plugins.fsdp2.lean_activations` and :mod:`~rlite.plugins.fsdp2.compile`.

A plugin package like any other: registered by :data:`rlite.plugin_manager.DEFAULT_PLUGINS` through
``pm.register`` (the default config names it, so it is there whatever ``plugins.autoload`` says), and it
imports only :mod:`rlite.api` and its own modules, as the ``megatron`` backend does.
"""

from __future__ import annotations

from rlite.api import hookimpl


def make_fsdp2(config, cfg, device, total_optimizer_steps):
    import torch.distributed as dist

    from rlite.api import optimizer_offload_dir
    from rlite.plugins.fsdp2.backend import FSDP2Backend

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
