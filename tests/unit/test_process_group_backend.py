"""The default group's backend: gloo on a CPU machine; on a GPU machine NCCL for CUDA tensors and
gloo for the host tensors of rlite's control collectives (the CUDA half is checked by
tests/gpu/test_process_group.py)."""

from __future__ import annotations

from rlite.distributed import process_group_backend


def test_a_gpu_machine_maps_host_tensors_to_gloo_and_cuda_tensors_to_nccl():
    pairs = dict(part.split(":") for part in process_group_backend(True).split(","))
    assert pairs == {"cpu": "gloo", "cuda": "nccl"}
    assert process_group_backend(False) == "gloo"
