"""The trainer ranks whose GPUs one SGLang engine runs on: its leader drives the engine, the other
ranks (members) hand it their prompts and their weight payloads.

Messages are point-to-point objects (``send_object_list`` / ``recv_object_list``) on the default process
group, so no rank outside the group takes part and no process group is created; on the thread that set
one (:func:`rlite.distributed.use_thread_group`: the asynchronous rollouts' producer), on that group, so
that its generations never interleave with the trainer thread's messages and collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from rlite.api import Completion, EngineCapabilities, EngineError, SamplingParams, thread_group


class EngineGroup:
    """Object messages between an engine's leader (``ranks[0]``) and its members, in rank order."""

    def __init__(self, ranks: Sequence[int], rank: int) -> None:
        self.ranks = tuple(ranks)
        self.rank = rank
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in the engine group {self.ranks}")

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def size(self) -> int:
        return len(self.ranks)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the leader, in rank order (None on the members)."""
        import torch.distributed as dist

        if not self.is_leader:
            dist.send_object_list([obj], dst=self.leader, group=thread_group())
            return None
        out = [obj]
        for rank in self.ranks[1:]:
            box = [None]
            dist.recv_object_list(box, src=rank, group=thread_group())
            out.append(box[0])
        return out

    def scatter(self, objs: Sequence[Any] | None) -> Any:
        """``objs[i]`` of the leader on the group's i-th rank."""
        import torch.distributed as dist

        if self.is_leader:
            for rank, obj in zip(self.ranks[1:], list(objs)[1:]):
                dist.send_object_list([obj], dst=rank, group=thread_group())
            return objs[0]
        box = [None]
        dist.recv_object_list(box, src=self.leader, group=thread_group())
        return box[0]

    def share(self, obj: Any) -> Any:
        """The leader's ``obj`` on every rank of the group."""
        return self.scatter([obj] * self.size if self.is_leader else None)


def generate_for_group(generate, group: EngineGroup, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
    """The leader samples every rank's prompts in one call (one SGLang batch) with its own parameters;
    each rank gets its own completions, ``prompt_index`` counted in its own prompts."""
    requests = group.gather((prompts, params))
    parts = None
    if group.is_leader:
        for rank, (_, other) in zip(group.ranks, requests):
            if {**vars(other), "seed": None} != {**vars(params), "seed": None}:
                raise EngineError(f"rank {rank} asked the engine for {other}, the leader for {params}")
        merged = [p for rank_prompts, _ in requests for p in rank_prompts]
        completions = generate(merged, params)
        parts, start = [], 0
        for rank_prompts, _ in requests:
            end = start + len(rank_prompts)
            parts.append([replace(c, prompt_index=c.prompt_index - start) for c in completions
                          if start <= c.prompt_index < end])  # fmt: skip
            start = end
    return group.scatter(parts)


class SGLangGroupMember:
    """The engine of a rank whose GPU runs a tensor-parallel rank of an SGLang engine that another rank
    drives: its prompts and its weight payloads go to that rank (:class:`EngineGroup`)."""

    def __init__(self, group: EngineGroup, capabilities: EngineCapabilities, *, bucket_bytes: int,
                 device: torch.device | None, metadata_cls: type, draft: Any = None) -> None:  # fmt: skip
        self.group = group
        self.draft = draft
        """The engine's :class:`~rlite.engines.base.DraftSpec`: a trained draft's weights go in a session of
        their own, in step with the leader's."""
        self.capabilities = capabilities
        self.bucket_bytes = bucket_bytes
        self.device = device
        """Where this rank packs its buckets: its own GPU, the one its TP rank of the engine runs on."""
        self.metadata_cls = metadata_cls
        self.weight_version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return generate_for_group(None, self.group, prompts, params)

    def update_weights(self, named_tensors, version: int) -> None:
        from rlite.plugins.sglang.speculative import sync_policy_and_draft

        sync_policy_and_draft(None, named_tensors or (), version, self.draft, bucket_bytes=self.bucket_bytes,
                              tp_size=self.group.size, metadata_cls=self.metadata_cls, output_str=False,
                              device=self.device, group=self.group)  # fmt: skip
        self.weight_version = int(version)

    def update_lora_adapter(self, named_tensors, config: dict, version: int) -> None:
        """The leader loads the adapter on every TP rank; this rank takes part in the stream's collectives."""
        for _ in named_tensors:
            pass
        self.weight_version = int(version)

    def release_memory(self) -> None:
        """The leader releases the engine's memory (on every GPU of the engine)."""

    def resume_memory(self) -> None:
        """The leader resumes it."""

    def shutdown(self) -> None:
        """The leader shuts the engine down."""
