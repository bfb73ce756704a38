"""Sharding a model with FSDP2 and loading it sharded (the checkpoint read once, on rank 0).

Used by the policy and reference models (:mod:`rlite.backends.fsdp2.backend`) and the critic
(:mod:`rlite.backends.fsdp2.critic`) alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from rlite.config import ModelConfig, ParallelismConfig
from rlite.hf_models import DTYPES, load_causal_lm
from rlite.training.logprobs import PolicyModel, causal_lm_of


def decoder_layers(policy: PolicyModel) -> list[nn.Module]:
    layers = getattr(causal_lm_of(policy.lm).get_decoder(), "layers", None)
    if layers is None:
        raise ValueError("model: cannot find the decoder blocks (expected model.get_decoder().layers)")
    return list(layers)


def apply_fsdp(policy: PolicyModel, cfg: ParallelismConfig, mesh=None) -> PolicyModel:
    """Shard each decoder block, then the root (embeddings, final norm, output layer); a single process
    with ``parallelism.shard_single_process=false`` keeps the plain module."""
    if not cfg.shard_single_process:
        import torch.distributed as dist

        world = mesh.size() if mesh is not None else (dist.get_world_size() if dist.is_initialized() else 1)
        if world == 1:
            return policy
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype])
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(policy):
        fully_shard(layer, **kwargs)
    fully_shard(policy, **kwargs)
    return policy


def load_sharded(model_cfg: ModelConfig, par_cfg: ParallelismConfig, device: torch.device,
                 wrap: Callable[[nn.Module], nn.Module]) -> nn.Module:  # fmt: skip
    """``wrap(load_causal_lm(model_cfg))`` sharded with :func:`apply_fsdp`, the checkpoint read once.

    In a world of one process the model is loaded on the host, moved to ``device`` and sharded (the
    plain module stays plain). With several ranks, only rank 0 reads the checkpoint (``from_pretrained``
    on the host, where the full model sits once, in the whole run); every rank builds the model on the
    meta device (no storage), shards it, allocates its own shard only, and receives it from rank 0
    tensor by tensor (``set_model_state_dict`` with ``broadcast_from_rank0``: a rank other than 0 holds
    one full tensor at a time, never the model). Buffers (the rotary embedding's, which no state dict
    carries) come from rank 0 too. ``wrap`` (LoRA, activation patches, the wrapper module) runs on both
    kinds of model alike, so rank 0's LoRA initialisation is every rank's.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return apply_fsdp(wrap(load_causal_lm(model_cfg)).to(device), par_cfg)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from rlite.hf_models import empty_causal_lm

    full_state, full_buffers = {}, {}
    if dist.get_rank() == 0:
        loaded = wrap(load_causal_lm(model_cfg))
        full_state = loaded.state_dict()
        full_buffers = dict(loaded.named_buffers())
        del loaded
    with torch.device("meta"):  # what wrap adds (LoRA matrices, a value head) has no storage either
        model = wrap(empty_causal_lm(model_cfg))
    model = apply_fsdp(model, par_cfg)
    model.to_empty(device=torch.device("cpu") if par_cfg.cpu_offload else device)  # this rank's shards only
    set_model_state_dict(
        model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    )
    del full_state
    for prefix, module in model.named_modules():  # buffers (non-persistent ones too) as rank 0 loaded them
        for name, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            buffer = buffer.to(device)
            if dist.get_rank() == 0:
                buffer.copy_(full_buffers[f"{prefix}.{name}" if prefix else name])
            dist.broadcast(buffer, src=0)
            module._buffers[name] = buffer
    return model
