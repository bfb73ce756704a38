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
from typing import TypeVar

import torch

T = TypeVar("T")


def to_device(value: T, device: torch.device) -> T:
    """``value`` with every tensor in it on ``device``: a tensor, or a dataclass, tuple, list or dict of
    them (nested), other values untouched. Host tensors reach a CUDA device through pinned memory,
    asynchronously (see the module docstring); tensors already on ``device`` are returned as they are."""
    if isinstance(value, torch.Tensor):
        return _tensor_to(value, device)  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
        moved = {name: to_device(item, device) for name, item in fields.items()}
        if all(moved[name] is item for name, item in fields.items()):
            return value  # nothing moved (the CPU): the very same object
        return dataclasses.replace(value, **moved)  # type: ignore[return-value]
    if isinstance(value, (list, tuple)):
        items = [to_device(item, device) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        if hasattr(value, "_fields"):  # a named tuple
            return type(value)(*items)  # type: ignore[return-value]
        return type(value)(items)  # type: ignore[return-value]
    if isinstance(value, dict):
        moved_items = {key: to_device(item, device) for key, item in value.items()}
        return value if all(moved_items[k] is v for k, v in value.items()) else moved_items  # type: ignore[return-value]
    return value


def _tensor_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device or (device.type == tensor.device.type == "cpu"):
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


