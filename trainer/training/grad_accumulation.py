"""Weight gradients added straight into ``.grad`` instead of through autograd's buffers.

Autograd hands each use of a weight a freshly allocated gradient. When a weight is used more than
once in a forward pass, its gradients wait in an input buffer until the last use has reported, are
summed out of place there, and only then added into ``.grad``. In rlite's training forward that is
every weight: with ``training.share_prompt_prefix`` each distinct prompt runs once and the responses
run against its cache, so every projection is used by two passes, and a tied output layer is also
the input embedding. On SmolLM2-135M with micro-batches of 8 sequences the buffered response-pass
gradients reach 0.23 GiB by the end of the response backward, and the tied 49k x 576 matrix holds
three 108 MiB copies at once; each micro-batch also writes every weight gradient three times
(fresh, summed, accumulated).

With accumulation in place, rlite's ops write the weight gradient of a matrix product directly into
``param.grad`` with ``addmm_`` (the GEMM adds into its output: no temporary) and the embedding's
gradient with ``index_add_`` into the rows it used; the op returns no gradient for the weight, so
autograd has nothing to buffer. Gradients are the same sums in a different order of float additions:
tested against autograd over accumulated micro-batches with shared prompts, tied embeddings and LoRA
(``tests/unit/test_grad_accumulation.py``), and as whole optimizer steps of the real backend against
FSDP2's (``tests/invariants/test_update_invariance.py``). Measured and tested on CPU only; it has not
run on a GPU.

It applies to parameters marked by :func:`accumulate_in_place` and only through rlite's own ops:
:class:`LinearFunction` and :class:`EmbeddingFunction` (swapped into plain ``nn.Linear`` and
``nn.Embedding`` modules), the lean SwiGLU and RMSNorm functions (:mod:`rlite.plugins.fsdp2.lean_activations`) and
the fused output layer (:class:`rlite.training.logprobs.LinearLogprobFunction`). Any other op that uses a marked
weight still returns its gradient, which autograd adds into the same ``.grad`` as usual.

Only a model that is not wrapped by FSDP2 can do this: FSDP2 swaps the parameters for unsharded
copies in every forward and reduces their gradients through its own hooks. ``parallelism.
fused_grad_accumulation`` (on by default) switches it where it applies (a single process whose
model stays plain: ``parallelism.shard_single_process=false``, or ``auto`` on one GPU). Gradient hooks
registered on a marked parameter (``register_post_accumulate_grad_hook``, ``Tensor.register_hook``) do not see the gradients
written in place.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

_MARK = "_rlite_grad_in_place"


def accumulate_in_place(model: nn.Module, skip: tuple[nn.Module, ...] | list[nn.Module] = ()) -> dict[str, int]:
    """Mark every trainable parameter of ``model`` for in-place gradient accumulation and swap the
    forward of its plain ``nn.Linear`` and ``nn.Embedding`` modules for :class:`LinearFunction` and
    :class:`EmbeddingFunction`, except inside ``skip`` (blocks that ``torch.compile`` takes, which
    cannot trace a backward writing ``.grad``: :mod:`rlite.plugins.fsdp2.compile`). Returns how many
    parameters and modules it changed."""
    counts = {"parameters": 0, "linear": 0, "embedding": 0}
    skipped_modules = {id(m) for block in skip for m in block.modules()}
    skipped_params = {id(p) for block in skip for p in block.parameters()}
    for param in model.parameters():
        if param.requires_grad and id(param) not in skipped_params:
            setattr(param, _MARK, True)
            counts["parameters"] += 1
    for module in model.modules():
        if id(module) in skipped_modules:
            continue
        if type(module) is nn.Linear and module.weight.requires_grad:
            module.forward = types.MethodType(_linear_forward, module)
            counts["linear"] += 1
        elif type(module) is nn.Embedding and module.weight.requires_grad and _plain_embedding(module):
            module.forward = types.MethodType(_embedding_forward, module)
            counts["embedding"] += 1
    return counts


def in_place(param: torch.Tensor | None) -> bool:
    return param is not None and getattr(param, _MARK, False)


def matmul_grad(param: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """The gradient ``dy^T x`` of ``y = x param^T`` (``dy``: ``[N, out]``, ``x``: ``[N, in]``).

    For a parameter accumulating in place it is added into ``param.grad`` (``addmm_``; set on the
    first micro-batch) and None is returned for autograd; otherwise it is returned.
    """
    if not in_place(param):
        return dy.t() @ x
    param.grad = add_matmul(param.grad, dy, x)
    return None


def add_matmul(into: torch.Tensor | None, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``into + dy^T x`` computed in ``into`` by the GEMM itself (``addmm_``), or ``dy^T x`` when
    ``into`` is None."""
    return dy.t() @ x if into is None else into.addmm_(dy.t(), x)


def vector_grad(param: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor | None:
    """A gradient computed whole (a norm's scale, a bias): added into ``param.grad`` when the parameter
    accumulates in place (None returned), otherwise returned."""
    if not in_place(param):
        return grad
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
    return None


class LinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight and bias gradients go through :func:`matmul_grad`
    and :func:`vector_grad`."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias = bias  # only read for its mark and .grad in backward
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = matmul_grad(weight, dy2, x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        db = vector_grad(ctx.bias, dy2.sum(0)) if ctx.needs_input_grad[2] else None
        return dx, dw, db


class EmbeddingFunction(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient is added row by row into
    ``weight.grad`` (``index_add_``) when the weight accumulates in place; the padding row gets none,
    as in ``nn.Embedding``."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        flat_ids, rows = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
        if ctx.padding_idx is not None:  # the padding token's rows add zero (selecting the others would
            # need their count: on a GPU, a wait for the device in every backward)
            rows = rows.masked_fill((flat_ids == ctx.padding_idx)[:, None], 0)
        if not in_place(weight):
            return None, add_rows(torch.zeros_like(weight), flat_ids, rows), None
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        add_rows(weight.grad, flat_ids, rows)
        return None, None, None


def add_rows(into: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``into[ids[i]] += rows[i]`` for every i, in place. On a GPU through ``index_put_(accumulate=True)``,
    whose kernel sorts the ids and sums each id's rows in a fixed order: ``index_add_`` adds them with atomics
    there, in whatever order the threads run, so two runs would differ in the last bits (autograd's own
    embedding backward sorts too). On a CPU ``index_add_`` adds in the ids' order, as before."""
    if into.device.type == "cpu":
        return into.index_add_(0, ids, rows)
    return into.index_put_((ids,), rows, accumulate=True)


def _plain_embedding(module: nn.Embedding) -> bool:
    return module.max_norm is None and not module.scale_grad_by_freq and not module.sparse


def _linear_forward(self, x):
    if not torch.is_grad_enabled():
        return F.linear(x, self.weight, self.bias)
    return LinearFunction.apply(x, self.weight, self.bias)


def _embedding_forward(self, ids):
    if not torch.is_grad_enabled():
        return F.embedding(ids, self.weight, self.padding_idx)
    return EmbeddingFunction.apply(ids, self.weight, self.padding_idx)
