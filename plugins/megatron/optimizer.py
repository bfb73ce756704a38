"""The megatron backend's optimizer side: master weights, gradient accumulation and reduction, and ZeRO-1.

What megatron-core does with ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer``, written in
rlite: 0.16.1's mixed-precision optimizer makes its master weights and scales as CUDA tensors
(``device='cuda'`` and ``param.type() == 'torch.cuda.BFloat16Tensor'`` checks in
``megatron/core/optimizer/optimizer.py``), and its distributed optimizer shards megatron's own DDP gradient
buffers, which this backend does not use (it reduces the gradients itself). The same ideas, on any device:

- **master weights** (``model.dtype`` differs from ``parallelism.param_dtype``): the model holds its
  parameters in ``param_dtype`` and computes with them; AdamW steps a copy in ``model.dtype`` (float32),
  and each step's result is cast back into the model. Otherwise AdamW steps the model's parameters
  themselves (float32 throughout, or pure bf16 with ``model.dtype=param_dtype=bfloat16``).
- **main gradients** (``parallelism.reduce_dtype`` differs from ``param_dtype``): as each micro-batch's
  gradient of a parameter is complete (``register_post_accumulate_grad_hook``) it is added into a buffer in
  ``reduce_dtype`` and the parameter's own gradient is dropped (megatron's ``main_grad``); the buffers are
  all-reduced over the data-parallel ranks in that dtype. Otherwise the gradients accumulate in
  ``param.grad`` and are reduced as they are.
- **ZeRO-1** (``parallelism.backend.args.distributed_optimizer``): each parameter's elements are split into
  equal slices over the ranks that hold copies of it (dense parameters over the data-parallel group, experts
  over the expert-data-parallel group); a rank keeps AdamW's moments (and the master weights) for its slice
  only, steps it after the reduction, and the updated slices are all-gathered into every copy. The
  gradients are still all-reduced whole (gloo has no reduce-scatter), as megatron's buffers are whole too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class MainParam:
    """One model parameter and what the optimizer steps for it."""

    name: str
    param: torch.nn.Parameter
    """The model's parameter (``param_dtype``), which forward and backward use."""
    main: torch.Tensor
    """What AdamW steps: ``param`` itself, a master copy in ``model.dtype``, or (ZeRO-1) this rank's slice of
    either, flat. A view of ``param`` wherever no copy is needed."""
    group: Any
    """The ranks holding copies of ``param`` (None: this rank alone): gradients are averaged over them, and
    ZeRO-1 splits ``param`` over them."""
    shard: slice | None
    """ZeRO-1: the elements of ``param.view(-1)`` that ``main`` holds (None: all of them, shaped as ``param``)."""
    main_grad: torch.Tensor | None
    """The gradient accumulated in ``reduce_dtype`` (None: it accumulates in ``param.grad``)."""
    accumulated: bool = False
    """Whether a gradient reached ``main_grad`` since the last step (an expert no token was routed to gets
    none, and like a parameter whose ``.grad`` is None it is not stepped)."""

    @property
    def is_copy(self) -> bool:
        return self.main.untyped_storage().data_ptr() != self.param.untyped_storage().data_ptr()

    def has_gradient(self) -> bool:
        return self.accumulated if self.main_grad is not None else self.param.grad is not None

    def gradient(self) -> torch.Tensor:
        """The accumulated gradient, whole: the main-gradient buffer or ``param.grad``; zeros where there is
        none (a reduction over ranks: every rank takes part in every one), and from then on it has one."""
        if self.main_grad is not None:
            self.accumulated = True
            return self.main_grad
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        return self.param.grad


def zero1_slice(numel: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s elements of a flat tensor of ``numel`` split over ``size`` ranks: ``ceil(numel / size)``
    each, the last ones shorter (or empty)."""
    chunk = -(-numel // size)
    return slice(min(rank * chunk, numel), min((rank + 1) * chunk, numel))


def group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


class MainParams:
    """The model's parameters with their master weights and main gradients (module docstring): builds the
    tensors the optimizer steps, reduces and hands over the gradients, and writes the step back into the model."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        masters: dict[str, torch.Tensor] | None,
        *,
        master_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        group_of: Callable[[str], Any],
        zero1: bool,
    ) -> None:
        """``masters``: the initial master weights by name (the checkpoint's values in ``master_dtype``, not
        the parameters rounded to ``param_dtype``); None when the model's parameters are the masters.
        ``group_of(name)``: the ranks holding copies of that parameter (None: this rank alone)."""
        self.zero1 = zero1
        self.params: list[MainParam] = []
        for name, param in named_params:
            group = group_of(name)
            size = group_size(group)
            shard = zero1_slice(param.numel(), dist.get_rank(group), size) if zero1 and size > 1 else None
            if masters is None:
                whole = param if shard is None else param.detach()  # AdamW steps the parameter itself
            else:
                whole = masters[name].detach().to(device=param.device, dtype=master_dtype).reshape(param.shape)
            if shard is not None:
                main = whole.reshape(-1)[shard]
                main = main.clone() if masters is not None else main  # a slice of a fresh copy: keep only it
            else:
                main = whole.clone() if masters is not None else whole
            main_grad = None
            if reduce_dtype != param.dtype:
                main_grad = torch.zeros(param.shape, dtype=reduce_dtype, device=param.device)
            self.params.append(MainParam(name, param, main, group, shard, main_grad))
            if main_grad is not None:
                param.register_post_accumulate_grad_hook(self._accumulate_hook(self.params[-1]))

    @staticmethod
    def _accumulate_hook(mp: MainParam) -> Callable[[torch.Tensor], None]:
        def accumulate(param: torch.Tensor) -> None:
            mp.main_grad.add_(param.grad)  # in reduce_dtype
            mp.accumulated = True
            param.grad = None

        return accumulate

    @property
    def has_copies(self) -> bool:
        """Whether AdamW steps copies (master weights) rather than the model's own parameters."""
        return any(mp.is_copy for mp in self.params)

    def optimized(self) -> list[torch.Tensor]:
        """The tensors AdamW steps (a rank's empty ZeRO-1 slices left out)."""
        return [mp.main for mp in self.params if mp.main.numel()]

    # -- a step -----------------------------------------------------------------------------------
    def reduce_gradients(self, dp_size: int) -> None:
        """Sum every gradient over the ranks holding copies of its parameter and divide by the data-parallel
        size (rlite scales each rank's loss for averaging over data-parallel ranks), in the gradient's dtype.
        An expert held by one rank alone (expert parallelism = world size) is divided too: its tokens came
        from every data-parallel rank."""
        if dp_size == 1:
            return
        for mp in self.params:
            grad = mp.gradient()
            if mp.group is not None:
                dist.all_reduce(grad, group=mp.group)
            grad.div_(dp_size)

    def squared_norms(self) -> list[tuple[MainParam, torch.Tensor]]:
        """``(param, sum of its gradient's squares in float64)``: for the global norm, before clipping."""
        return [(mp, mp.gradient().detach().double().square().sum()) for mp in self.params if mp.has_gradient()]

    def hand_gradients_to_optimizer(self, scale: float | None) -> None:
        """Set each optimized tensor's ``.grad``: this rank's part of the reduced gradient in the optimized
        tensor's dtype, times ``scale`` (clipping) when given. A parameter without a gradient gets none, so
        AdamW leaves it (and its moments) as they are, as torch's AdamW skips a ``.grad`` of None."""
        for mp in self.params:
            if not mp.has_gradient():
                continue
            grad = mp.gradient()
            if mp.shard is not None:
                grad = grad.reshape(-1)[mp.shard]
            if grad.dtype != mp.main.dtype or mp.main_grad is not None or mp.shard is not None:
                grad = grad.to(mp.main.dtype, copy=True)  # never the buffer itself: it is zeroed for the next step
            if scale is not None:
                grad.mul_(scale)
            mp.main.grad = grad

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """After AdamW's step: each master (slice) cast into the model's parameter; ZeRO-1's slices
        all-gathered from the ranks that stepped them."""
        for mp in self.params:
            if mp.shard is None:
                if mp.is_copy:
                    mp.param.copy_(mp.main)
                continue
            size = group_size(mp.group)
            chunk = -(-mp.param.numel() // size)
            mine = torch.zeros(chunk, dtype=mp.param.dtype, device=mp.param.device)
            mine[: mp.main.numel()] = mp.main
            slices = [torch.empty_like(mine) for _ in range(size)]
            dist.all_gather(slices, mine, group=mp.group)
            mp.param.view(-1).copy_(torch.cat(slices)[: mp.param.numel()])

    def zero_grad(self) -> None:
        for mp in self.params:
            mp.param.grad = None
            mp.main.grad = None
            if mp.main_grad is not None:
                mp.main_grad.zero_()
                mp.accumulated = False

    # -- weights out ------------------------------------------------------------------------------
    def full_master(self, mp: MainParam) -> torch.Tensor:
        """The whole master weight of ``mp``, shaped as its parameter (a collective over its group under
        ZeRO-1; otherwise the master or the parameter itself, not a copy)."""
        if mp.shard is None:
            return mp.main
        size = group_size(mp.group)
        chunk = -(-mp.param.numel() // size)
        mine = torch.zeros(chunk, dtype=mp.main.dtype, device=mp.main.device)
        mine[: mp.main.numel()] = mp.main.detach()
        slices = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(slices, mine, group=mp.group)
        return torch.cat(slices)[: mp.param.numel()].view(mp.param.shape)

    # -- bytes ------------------------------------------------------------------------------------
    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes this rank keeps for the optimizer in memory: the master copies and, for a torch AdamW,
        its moments (``DiskOffloadAdamW`` keeps them in files)."""
        total = sum(mp.main.numel() * mp.main.element_size() for mp in self.params if mp.is_copy)
        if isinstance(optimizer, torch.optim.AdamW):
            for state in optimizer.state.values():
                total += sum(v.numel() * v.element_size() for k, v in state.items() if k != "step")
        return total
