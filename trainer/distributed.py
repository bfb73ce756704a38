"""Process-group setup: gloo on CPU, nccl on GPU, one code path for every world size.

Under ``torchrun`` the usual environment variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) are present
and torchrun's own rendezvous joins the machines. Without them, a single process builds a world of
one from an in-memory store: no port, no launcher.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


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


def process_group_backend(use_cuda: bool) -> str:
    """The default group's backend: NCCL for CUDA tensors and gloo for host tensors on a GPU machine.

    rlite's small control collectives (metric sums, a preemption flag, reward failures, the async
    producers' agreement) reduce CPU tensors, which an NCCL-only group cannot carry ("no backend type
    associated with device type cpu"); each tensor goes to the backend of its device."""
    return "cpu:gloo,cuda:nccl" if use_cuda else "gloo"


SHARED_STORE_RESTARTS_HINT = (
    "torchrun restarts this group (--max-restarts > 0) and its workers share the rendezvous store: a restarted "
    "group can read the dead group's addresses from it and fail to connect (pytorch issue 135712). Start "
    "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (docs/cluster.md)"
)


def restarts_share_the_rendezvous_store(env: dict[str, str]) -> bool:
    """Whether torchrun (``env``: a worker's environment) may restart this group while its workers use the
    agent's rendezvous store for their own keys, which outlive the group that wrote them."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def init_distributed(timeout_s: float = 1800.0) -> DistContext:
    """Initialise (or reuse) the default process group and pick this rank's device.

    ``timeout_s`` bounds a collective whose peer is alive but silent (a hung rank); a rank whose process died
    fails its peers' collectives at once (gloo: "Connection reset by peer"), and torchrun then stops the rest."""
    if restarts_share_the_rendezvous_store(dict(os.environ)) and os.environ.get("LOCAL_RANK", "0") == "0":
        logger.warning(SHARED_STORE_RESTARTS_HINT)  # once per node
    use_cuda = torch.cuda.is_available()
    backend = process_group_backend(use_cuda)
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


def leave_rank_process(code: int) -> None:
    """End a rank's process with ``code`` through ``os._exit``, after flushing its logs and streams.

    For a process that was a rank of a multi-rank group and has finished its work (outputs written,
    loggers closed, group destroyed): the interpreter's own teardown then never runs. In it, gloo's
    worker threads, still owned by objects that outlive ``destroy_process_group`` (device meshes, FSDP2
    states), were destroyed while joinable in about one two-rank run in ten here ("terminate called
    without an active exception", SIGABRT after the work had finished), which turned a finished run
    into a failed one for its launcher.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to say on it
            pass
    os._exit(code)


def spawn_local_ranks(fn: Any, args: tuple[Any, ...], nprocs: int, timeout_s: float = 600.0) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes on this machine and wait for all of
    them (at most ``timeout_s``; then the ranks are killed and this raises ``TimeoutError``).

    Each rank leaves through :func:`leave_rank_process` once ``fn`` has returned. An exception in
    ``fn`` still fails the call with its traceback (``ProcessRaisedException``)."""
    import torch.multiprocessing as mp

    context = mp.start_processes(_run_then_leave, args=(fn, args), nprocs=nprocs, start_method="spawn",
                                 join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} ranks did not finish in {timeout_s:.0f} s")


def _run_then_leave(rank: int, fn: Any, args: tuple[Any, ...]) -> None:
    fn(rank, *args)
    leave_rank_process(0)


@dataclass(frozen=True)
class DataLayout:
    """Which shard of the data each rank trains on, as the training backend lays its ranks out.

    ``size`` data-parallel shards; the ranks of ``group`` hold different shards (None: the whole
    world). Ranks that hold the same shard (a backend's tensor-parallel ranks) form a *replica* of
    ``replica_size`` ranks: its rank 0 (the leader) generates and scores, the others receive the batch.
    With FSDP2 every rank is its own shard and replica.
    """

    rank: int
    size: int
    group: Any = None
    replica_rank: int = 0
    replica_size: int = 1
    replica_group: Any = None
    replica_leader: int = 0
    """Global rank of the replica's leader (the source of its broadcasts)."""

    @property
    def leader(self) -> bool:
        return self.replica_rank == 0

    @classmethod
    def whole_world(cls) -> DataLayout:
        """Every rank a shard of its own."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        size = dist.get_world_size() if dist.is_initialized() else 1
        return cls(rank=rank, size=size, replica_leader=rank)


# rlite's collectives below take ``group=None`` to mean every rank, sent on the calling thread's group
# (:func:`thread_group`): the default group on the trainer's thread, the producer's own group on the
# asynchronous rollouts' producer thread. So no code reached from the producer (sampling, rewards,
# dynamic sampling, hooks that use these functions) can issue a collective on the default group, where
# the trainer thread's collectives run: two threads on one gloo or NCCL group could start their
# collectives in different orders on different ranks and pair up collectives that do not match.


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _on_this_thread(group: Any) -> Any:
    """``group``, or for ``None`` (every rank) the calling thread's group of every rank."""
    return thread_group() if group is None else group


def all_reduce_sum(values: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum a small float64 tensor over the ranks of ``group`` (default: all; a copy in a world of one)."""
    out = values.detach().to(torch.float64).clone()
    group = _on_this_thread(group)
    if dist.is_initialized() and _group_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


def all_reduce_max(values: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The elementwise maximum of a small int64 tensor over the ranks of ``group`` (a copy in a world of one)."""
    out = values.detach().to(torch.int64).clone()
    group = _on_this_thread(group)
    if dist.is_initialized() and _group_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def new_side_group() -> Any:
    """A process group of every rank, of the default group's backend and timeout, for collectives that
    a second thread issues while the main thread uses the default group (with NCCL: a communicator of
    its own); ``None`` in a world of one. A collective: every rank calls it, in the same order.

    Why two threads may each run collectives at once, one per group: a gloo group is an object of its
    own (its TCP connections, its worker threads and work queue, its count of collectives, which pairs
    each collective with the same one on the other ranks), and so is an NCCL communicator. Only two
    threads on *one* group are unsafe: each rank would order their collectives by its own timing. So
    each group is used by one thread (the side group: the producer's, created before it starts and
    destroyed after it ends), which :func:`thread_group` makes the default of rlite's collectives."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if torch.cuda.is_available():  # "cpu:gloo,cuda:nccl", as the default group (process_group_backend)
        return dist.new_group(backend=dist.get_backend_config())
    return dist.new_group(backend=dist.get_backend())


_this_thread = threading.local()


def thread_group() -> Any:
    """The process group of the calling thread's messages to other ranks that take no group argument
    (an engine group's, :mod:`rlite.plugins.sglang.group`): the one :func:`use_thread_group` set on this
    thread, else ``None`` (the default group)."""
    return getattr(_this_thread, "group", None)


def use_thread_group(group: Any) -> None:
    """Send this thread's group-less messages on ``group`` (the asynchronous rollouts' producer thread)."""
    _this_thread.group = group


def all_gather_objects(obj, group: Any = None):
    """Gather one picklable object per rank of ``group`` (default: all) into a list ordered by rank."""
    group = _on_this_thread(group)
    if not dist.is_initialized() or _group_size(group) == 1:
        return [obj]
    out = [None] * _group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int, group: Any = None):
    """``obj`` of global rank ``src`` on every rank of ``group`` (unchanged where the group is one rank)."""
    group = _on_this_thread(group)
    if not dist.is_initialized() or _group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def from_replica_leader(layout: DataLayout, make: Callable[[], Any]) -> Any:
    """``make()`` on the replica's leader, its result on every rank of the replica (the leader samples and
    scores for its replica)."""
    if layout.replica_size == 1:
        return make()
    return broadcast_object(make() if layout.leader else None, layout.replica_leader, layout.replica_group)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=thread_group())
