"""Where each SGLang engine runs and how much memory it takes (SGLang 0.5.23's ServerArgs).

**GPUs.** An engine with ``tp_size`` T runs its TP rank i on GPU ``base_gpu_id + i`` as its own process
numbers GPUs (``gpu_id_step`` 1; ``srt/arg_groups/fields/device.py``). rlite starts one engine per T
consecutive engine ranks of a machine, on the first of them, with ``base_gpu_id`` = that rank's GPU, so
TP rank i sits on the GPU of the group's i-th trainer rank, and that trainer rank hands SGLang's TP
rank i its weights (its own CUDA-IPC payload, on the same GPU). A machine with a single engine rank
(one trainer process) may run an engine on more GPUs than it has trainer ranks: its extra TP ranks read
the trainer's buffers from their GPU.

**Memory.** SGLang sizes its static memory (weights and KV cache) as ``mem_fraction_static`` times the
GPU memory it finds *free* when it starts (``pre_model_load_memory``, the minimum over its TP ranks;
``srt/mem_cache/kv_cache_configurator.py: _profile_available_bytes``), and keeps the rest as slack for
its activations and CUDA graphs. What the trainer already holds when the engine starts (policy,
reference, critic) is therefore outside SGLang's share by construction. What the trainer allocates
*later* and keeps through rollouts (optimizer states, created at the first step) and the trainer's
transient buffers of the first weight sync (which runs while the KV cache is allocated) must come out
of the slack, besides SGLang's own runtime needs::

    slack = F_min * (1 - mem_fraction_static) >= max_i bytes_to_come_i + runtime_reserve + 2 * bucket
    mem_fraction_static = 1 - (max_i bytes_to_come_i + runtime_reserve + 2 * bucket) / F_min

and the static share ``F_min * mem_fraction_static`` must hold more than the engine's weights.
``runtime_reserve`` defaults to an eighth of the GPU's memory and at least 2 GiB (SGLang reserves
10 GiB on a GPU above 60 GiB when it sizes itself).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rlite.api import ConfigError, RankDevice

GIB = 1 << 30


@dataclass(frozen=True)
class EnginePlan:
    """One SGLang engine: which trainer ranks it serves and its placement ServerArgs."""

    ranks: tuple[int, ...]
    """The trainer ranks on the engine's GPUs, in TP order; the first runs the engine."""
    tp_size: int
    base_gpu_id: int
    mem_fraction_static: float | None
    """None: SGLang sizes itself (no GPU to measure, e.g. CPU tests)."""

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def server_args(self) -> dict:
        args = dict(tp_size=self.tp_size, base_gpu_id=self.base_gpu_id, gpu_id_step=1)
        if self.mem_fraction_static is not None:
            args["mem_fraction_static"] = self.mem_fraction_static
        return args


def engine_groups(engine_ranks: Sequence[RankDevice], tp_size: int) -> list[tuple[RankDevice, ...]]:
    """Consecutive runs of ``tp_size`` engine ranks on one machine; a machine with one engine rank
    gets one engine whatever ``tp_size``."""
    if tp_size < 1:
        raise ConfigError(f"rollout.engine.args.tp_size must be >= 1, got {tp_size}")
    by_host: dict[str, list[RankDevice]] = {}
    for rank in engine_ranks:
        by_host.setdefault(rank.host, []).append(rank)
    groups = []
    for host, ranks in by_host.items():
        if len(ranks) == 1:
            groups.append((ranks[0],))
            continue
        if len(ranks) % tp_size:
            raise ConfigError(
                f"rollout.engine.args.tp_size={tp_size} must divide the {len(ranks)} engine ranks on {host} "
                f"(ranks {[r.rank for r in ranks]}): each engine runs on the GPUs of {tp_size} trainer ranks"
            )
        groups += [tuple(ranks[i : i + tp_size]) for i in range(0, len(ranks), tp_size)]
    return groups


def check_consecutive_gpus(group: Sequence[RankDevice]) -> int:
    """``base_gpu_id`` of the engine on ``group``'s GPUs: SGLang puts TP rank i on GPU base + i as the
    engine's process numbers them, so the group's GPUs must be consecutive there."""
    leader = group[0]
    base = leader.gpu_index if leader.gpu_index is not None else leader.local_rank
    for i, member in enumerate(group):
        if leader.gpu_index is None:  # no GPUs (CPU runs): local ranks stand for them
            expected_ok = member.local_rank == base + i
            seen = f"local rank {member.local_rank}"
        else:
            index = base + i
            expected_ok = index < len(leader.visible_gpus) and leader.visible_gpus[index] == member.gpu_uuid
            seen = f"GPU {member.gpu_uuid}"
        if not expected_ok:
            raise ConfigError(
                f"rollout.engine.args.tp_size={len(group)}: SGLang would run TP rank {i} of the engine of "
                f"rank {leader.rank} on GPU {base + i} of that process, but trainer rank {member.rank} "
                f"runs on {seen}. Give every rank of a machine all its GPUs, in local-rank order "
                "(torchrun's default, without per-rank CUDA_VISIBLE_DEVICES), or use tp_size=1."
            )
    return base


def mem_fraction_static(
    group: Sequence[RankDevice], *, runtime_reserve_bytes: int | None, bucket_bytes: int, weight_bytes: int,
    tp_size: int,
) -> float | None:
    """The ``mem_fraction_static`` of an engine on ``group``'s GPUs (see the module docstring), or None
    where there is no GPU memory to measure."""
    measured = [r for r in group if r.free_bytes is not None]
    if not measured:
        return None
    free = min(r.free_bytes for r in measured)
    total = min(r.total_bytes or r.free_bytes for r in measured)
    reserve = runtime_reserve_bytes if runtime_reserve_bytes is not None else max(2 * GIB, total // 8)
    keep = max(r.bytes_to_come for r in group) + reserve + 2 * bucket_bytes  # the sync's buckets
    fraction = math.floor((1.0 - keep / free) * 1000) / 1000  # SGLang keeps three decimals
    static = fraction * free
    per_gpu_weights = weight_bytes / tp_size
    if static <= per_gpu_weights:
        raise ConfigError(
            f"rollout.engine.args.mem_fraction_static: the SGLang engine on ranks {[r.rank for r in group]} "
            f"would get {max(static, 0) / GIB:.1f} GiB for weights and KV cache ({free / GIB:.1f} GiB free, "
            f"{keep / GIB:.1f} GiB kept for the trainer's optimizer states ({max(r.bytes_to_come for r in group) / GIB:.1f}), "
            f"SGLang's runtime ({reserve / GIB:.1f}, rollout.engine.args.runtime_reserve_gb) and the weight sync's "
            f"buckets), but its weights alone take {per_gpu_weights / GIB:.1f} GiB per GPU. Free device memory "
            "(parallelism.cpu_offload=true, training.optimizer_offload=disk, a larger world size), spread the "
            "engine over more GPUs (rollout.engine.args.tp_size), or set mem_fraction_static yourself."
        )
    return fraction


def plan_engines(
    engine_ranks: Sequence[RankDevice], *, tp_size: int, mem_fraction: float | None = None,
    runtime_reserve_bytes: int | None = None, bucket_bytes: int = 512 << 20, weight_bytes: int = 0,
) -> list[EnginePlan]:
    """Every SGLang engine of the run (the same answer on every rank).

    ``mem_fraction`` set by the user wins over the computed one; ``weight_bytes`` is the engine's
    weights in its dtype (all TP ranks together).
    """
    plans = []
    for group in engine_groups(engine_ranks, tp_size):
        base = check_consecutive_gpus(group)
        fraction = mem_fraction
        if fraction is None:
            fraction = mem_fraction_static(
                group, runtime_reserve_bytes=runtime_reserve_bytes, bucket_bytes=bucket_bytes,
                weight_bytes=weight_bytes, tp_size=tp_size,
            )  # fmt: skip
        plans.append(EnginePlan(tuple(r.rank for r in group), tp_size, base, fraction))
    return plans


def plan_of(plans: Sequence[EnginePlan], rank: int) -> EnginePlan:
    """The engine whose GPUs include ``rank``'s."""
    (plan,) = [p for p in plans if rank in p.ranks]
    return plan


def engine_weight_bytes(model_path: str, dtype, *, quantized: bool = False) -> int:
    """Bytes of the engine's weights: every parameter of the model in ``dtype`` (a model built on the
    meta device, nothing allocated), decoder-block projections at one byte with FP8 quantization."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, param in model.named_parameters():
        fp8 = quantized and param.dim() == 2 and ".layers." in name and name.endswith("_proj.weight")
        total += param.numel() * (1 if fp8 else size)
    return total
