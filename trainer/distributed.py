"""Process-group setup: gloo on CPU, nccl on GPU, one code path for every world size.

Under ``torchrun`` the usual environment variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) are present
and torchrun's own rendezvous joins the machines. Without them, a single process builds a world of
one from an in-memory store: no port, no launcher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float = 1800.0) -> DistContext:
    """Initialise (or reuse) the default process group and pick this rank's device."""
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    owns = False
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s)
            )
        owns = True
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return DistContext(rank, world, local_rank, device, owns)


def shutdown_distributed(ctx: DistContext, *, finished: bool = False) -> None:
    """Destroy the process group this run created.

    ``finished=True`` (the run ended normally on every rank) first waits for the other ranks, so no
    rank tears its group down while another still works in it (rank 0 writing the export): gloo
    aborted a rank that did in one of nine two-rank test runs here.
    """
    if ctx.owns_group and dist.is_initialized():
        if finished and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a small float64 tensor over ranks (a no-op copy in a world of one)."""
    out = values.detach().to(torch.float64).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
    return out


def all_gather_objects(obj):
    """Gather one picklable object per rank into a list ordered by rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
