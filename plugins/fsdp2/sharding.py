"""Sharding a model with FSDP2 and loading it sharded (the checkpoint read once, on rank 0).

Used by the policy and reference models (:mod:`rlite.plugins.fsdp2.backend`) and the critic
(:mod:`rlite.plugins.fsdp2.critic`) alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from rlite.api import ModelConfig, ParallelismConfig, PolicyModel, load_causal_lm
from rlite.plugins.fsdp2.compile import decoder_blocks


def decoder_layers(policy: PolicyModel) -> list[nn.Module]:
    return decoder_blocks(policy.lm)


def shards_single_process(setting: bool | str, device_type: str, *, param_dtype: str, model_dtype: str,
                          cpu_offload: bool) -> bool:  # fmt: skip
    """Whether a world of one process wraps its model in FSDP2 (``parallelism.shard_single_process``).

    ``true`` / ``false`` are taken as they are. ``auto`` (the default) resolves by the device type:

    - **CPU**: FSDP2, as rlite always did there (one code path for one rank and N; the CPU numbers in
      ``benchmarks/RESULTS.md`` were measured so).
    - **CUDA**: the plain model, unless FSDP2 implements a setting the run asks for: ``cpu_offload``
      (FSDP2's CPUOffloadPolicy), or compute in another dtype than the master weights
      (``param_dtype`` != ``model.dtype``: fp32 masters with bf16 compute, FSDP2's mixed precision).

    Why plain on one GPU: at world size 1, FSDP2 still copies every block's weights into a fresh unsharded
    buffer before its forward and again before its backward (``reshard_after_forward``), copies the
    gradients out after the backward, and runs Python hooks around every block, for every micro-batch,
    sharding nothing. The plain model has none of it, and its weight gradients are added into ``.grad``
    in place (``parallelism.fused_grad_accumulation``). Pure bf16 (``model.dtype=param_dtype=bfloat16``)
    and fp32 then run plain.

    Why fp32 masters with bf16 compute keep FSDP2 (the alternative is TRL's: the plain fp32 model under
    ``torch.autocast(bfloat16)``):

    - *Numerics*: FSDP2's mixed precision computes exactly as a bf16 copy of the model does (bf16
      weights, bf16 residual stream, norms upcast inside as Hugging Face writes them). The bf16 log-prob
      tolerance of ``tests/gpu/test_fsdp2_bf16.py`` and the bitwise engine/trainer equality of true
      on-policy mode in bf16 (``tests/gpu/test_true_on_policy_cuda.py``, an engine loaded in bf16) were
      measured on that. Autocast computes something else (the residual stream and every op outside its
      cast lists stay fp32): true on-policy mode would lose its bitwise equality with a bf16 engine.
    - *Memory*: autocast caches a bf16 copy of every weight from the forward until the backward that uses
      it, and keeps the residual stream in fp32; FSDP2 holds one block's bf16 copy at a time and frees it
      after the block (``reshard_after_forward``). The GPU issue asks for peak memory at most 0.6x TRL's.
    - *Code*: rlite's own autograd functions (lean activations, in-place gradient accumulation, the fused
      output layer) save and use their weights as given; under autocast each would have to cast them
      itself to avoid fp32 matrix products in backward.
    - *Cost*: the copies FSDP2 adds at world size 1 are memory traffic (a few GB per micro-batch for a
      0.5B model, about a millisecond each on an H200) and hooks that overlap with compute when a
      micro-batch is large. That cost is measurable directly: pure bf16 with ``shard_single_process=true``
      against ``auto`` (plain) on a GPU. If it turns out large, autocast is the next step.
    """
    if setting != "auto":
        return bool(setting)
    if device_type != "cuda":
        return True
    return cpu_offload or param_dtype != model_dtype


def apply_fsdp(policy: PolicyModel, cfg: ParallelismConfig, mesh=None, *, sharded: bool = True) -> PolicyModel:
    """Shard each decoder block, then the root (embeddings, final norm, output layer); ``sharded=False`` (a
    single process whose ``parallelism.shard_single_process`` resolves to plain) keeps the plain module."""
    if not sharded:
        return policy
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.param_dtype), reduce_dtype=getattr(torch, cfg.reduce_dtype))
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
        sharded = shards_single_process(par_cfg.shard_single_process, device.type, param_dtype=par_cfg.param_dtype,
                                        model_dtype=model_cfg.dtype, cpu_offload=par_cfg.cpu_offload)
        if not sharded and par_cfg.param_dtype != model_cfg.dtype:
            raise ValueError(
                f"parallelism.shard_single_process=false keeps the model plain, in model.dtype={model_cfg.dtype}, so it "
                f"cannot compute in parallelism.param_dtype={par_cfg.param_dtype}: set them equal, or "
                "shard_single_process=auto (FSDP2's mixed precision)")
        return apply_fsdp(wrap(load_causal_lm(model_cfg)).to(device), par_cfg, sharded=sharded)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from rlite.api import empty_causal_lm

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
