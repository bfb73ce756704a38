"""The default process group on a GPU machine carries both kinds of tensor rlite reduces: CUDA tensors
(FSDP2's, over NCCL) and the small host tensors of its control collectives (metric sums, the
preemption flag, reward failures, the async producers' agreement, over gloo). An NCCL-only group
fails the second kind on every multi-GPU run. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_default_group_reduces_host_and_cuda_tensors_and_side_groups_do_too(monkeypatch):
    from rlite.distributed import init_distributed, new_side_group, shutdown_distributed

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    ctx = init_distributed()
    try:
        config = dist.get_backend_config().replace(" ", "")
        assert "cpu:gloo" in config and "cuda:nccl" in config
        host, device = torch.tensor([2.0]), torch.tensor([3.0], device=ctx.device)
        dist.all_reduce(host)  # a world of one still goes through the backend of the tensor's device
        dist.all_reduce(device)
        assert host.item() == 2.0 and device.item() == 3.0
        side = dist.new_group(backend=dist.get_backend_config())  # what new_side_group builds at N ranks
        dist.all_reduce(host, group=side)
        dist.all_reduce(device, group=side)
        assert new_side_group() is None  # a world of one needs none
    finally:
        shutdown_distributed(ctx, finished=True)
