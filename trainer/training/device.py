"""Moving what a micro-batch's forward and loss need to the training device, without waiting for it.

The rollout batch lives in host memory: rewards, advantages and the loss inputs are built there. On a
GPU, a plain ``tensor.to("cuda")`` from pageable host memory returns only once the copy is done, and
the copy is queued behind every kernel already launched: the host waits for the GPU to drain, then
the GPU waits for the host to launch the next kernels. The micro-batch loop would stall like that at
every copy. :func:`to_device` instead stages each tensor in pinned (page-locked) memory and queues an
asynchronous copy (``non_blocking=True``): the host goes on launching kernels, and the copy runs in
stream order before the kernels that read it. PyTorch's pinned-memory allocator keeps the staging
block until the copy has run, so it may be dropped at once.

On the CPU every tensor is already where it is used: :func:`to_device` returns its argument unchanged
(no copy, no pinning), so CPU runs do exactly what they did before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def to_device(value: T, device: torch.device) -> T:
    """``value`` with every tensor in it on ``device``: a tensor, or a dataclass, tuple, list or dict of
    them (nested), other values untouched. Host tensors reach a CUDA device through pinned memory,
    asynchronously (see the module docstring); tensors already on ``device`` are returned as they are."""
    if isinstance(value, torch.Tensor):
        return _tensor_to(value, device)  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved = {f.name: to_device(getattr(value, f.name), device) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **moved)  # type: ignore[return-value]
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)  # type: ignore[return-value]
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}  # type: ignore[return-value]
    return value


def _tensor_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device or (device.type == tensor.device.type == "cpu"):
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def pinned_host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's values on the host, for results read once after a loop (log-probs, metrics):
    one copy that waits for the device, instead of one per micro-batch. A host tensor is returned as it is."""
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


def module_device(module: Any) -> torch.device:
    """The device of a module's first parameter (the host for a module without any)."""
    param = next(iter(module.parameters()), None)
    return torch.device("cpu") if param is None else param.device
