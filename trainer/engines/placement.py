"""Where a run's processes sit and what their devices hold: what an engine factory is told.

Every rank describes itself (:func:`describe_rank`: host, GPU index and UUID, free memory, what its
trainer will still allocate) and :func:`gather_engine_context` hands every rank the table of all of
them, so an engine that spans the GPUs of several trainer ranks (SGLang with tensor parallelism) can
lay itself out and size its memory without collectives of its own.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from rlite.metrics import MetricsSink


@dataclass(frozen=True)
class RankDevice:
    """One rank of the run, as the engine factories see it."""

    rank: int
    host: str
    local_rank: int
    gpu_index: int | None
    """The rank's GPU as this rank's process numbers it (``torch.cuda.current_device()``); None on CPU."""
    gpu_uuid: str | None
    """That GPU's UUID (the same in every process, whatever its ``CUDA_VISIBLE_DEVICES``)."""
    visible_gpus: tuple[str, ...] = ()
    """UUIDs of the GPUs this process sees, by index."""
    free_bytes: int | None = None
    """Device memory free when the engines are about to start (after the trainer returned its cached
    blocks); None on CPU."""
    total_bytes: int | None = None
    bytes_to_come: int = 0
    """Device memory the rank's trainer will still allocate and keep through every rollout (optimizer
    states created at the first step)."""
    builds_engine: bool = True
    """Whether the rank builds an engine (False for a tensor-parallel training rank whose replica's
    leader generates)."""


@dataclass(frozen=True)
class EngineContext:
    """What an engine factory is told about the process it runs in and the trainer beside it."""

    rank: int
    ranks: tuple[RankDevice, ...]
    """Every rank of the run, by rank."""
    quantizer: tuple | None = None
    """``(quantize, config)`` of ``rollout.quantization``, or None."""
    draft: Any = None
    """The speculative draft's :class:`rlite.api.DraftSpec` (``rollout.draft``), or None; an engine
    registered with ``draft_methods`` runs it."""
    compute_dtype: str | None = None
    """The dtype the trainer's forward computes in (``parallelism.param_dtype``: bfloat16 under mixed
    precision with float32 master weights); None where not known (tests, scripts)."""
    metrics: MetricsSink = field(default_factory=MetricsSink, compare=False)
    """Where the engine reports numbers for the step's metrics row (``metrics.report({...})``): the rollout
    stage drains it after each step's rollout, an evaluation into ``eval/<name>``. Shared by every engine the
    run builds from this context (a wrapper and the engine it wraps, an engine restarted after a crash)."""

    @property
    def this(self) -> RankDevice:
        return self.ranks[self.rank]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def engine_ranks(self) -> tuple[RankDevice, ...]:
        return tuple(r for r in self.ranks if r.builds_engine)

    @classmethod
    def single_process(cls, *, quantizer: tuple | None = None, draft: Any = None, compute_dtype: str | None = None,
                       **rank_fields) -> EngineContext:
        """A run of one process on CPU (tests, scripts); ``rank_fields`` override :class:`RankDevice`'s."""
        fields = dict(rank=0, host="localhost", local_rank=0, gpu_index=None, gpu_uuid=None)
        return cls(rank=0, ranks=(RankDevice(**{**fields, **rank_fields}),), quantizer=quantizer, draft=draft,
                   compute_dtype=compute_dtype)


def describe_rank(rank: int, local_rank: int, device: torch.device, *, bytes_to_come: int, builds_engine: bool) -> RankDevice:
    """This rank's entry of the table (measures free device memory after emptying torch's cache)."""
    if device.type != "cuda":
        return RankDevice(rank, socket.gethostname(), local_rank, None, None,
                          bytes_to_come=int(bytes_to_come), builds_engine=builds_engine)  # fmt: skip
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # blocks torch keeps cached count as used for another process
    free, total = torch.cuda.mem_get_info(device)
    visible = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))
    return RankDevice(
        rank, socket.gethostname(), local_rank, device.index, visible[device.index], visible,
        free_bytes=int(free), total_bytes=int(total), bytes_to_come=int(bytes_to_come), builds_engine=builds_engine,
    )  # fmt: skip


def gather_engine_context(this: RankDevice, quantizer: tuple | None, draft: Any = None,
                          compute_dtype: str | None = None) -> EngineContext:
    """Every rank's :class:`RankDevice`, on every rank (a collective: all ranks call it)."""
    from rlite.distributed import all_gather_objects

    ranks = tuple(all_gather_objects(this))
    return EngineContext(rank=this.rank, ranks=ranks, quantizer=quantizer, draft=draft, compute_dtype=compute_dtype)
