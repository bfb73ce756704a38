"""A rank's local experts as two grouped matrix products instead of megatron's loop over experts.

megatron-core 0.16.1 without Transformer Engine runs its MoE experts as ``SequentialMLP``: for each local
expert a megatron ``MLP`` (``linear_fc1``, SwiGLU, the router's probability, ``linear_fc2``) on that
expert's slice of the permuted tokens. Its grouped alternatives need Transformer Engine (``TEGroupedMLP``)
or the ``grouped_gemm`` package and bf16 (``GroupedMLP``). :class:`GroupedExperts` keeps
``SequentialMLP``'s modules, parameters and state dict (so conversion, checkpoints, weight sync and the
gradient reductions see the same names) and replaces its forward by torch's ``grouped_mm`` over the
stacked weights, with the tokens already in expert order (megatron's token dispatcher permutes them so):

    h_e = x_e W1_e^T,   a_e = silu(h_e[:, :F]) * h_e[:, F:] * p_e,   y_e = a_e W2_e^T

for the ``n_e`` tokens ``x_e`` of expert ``e`` with router probabilities ``p_e``: the same products and
elementwise ops in the same order as ``SequentialMLP``'s per-expert ``MLP``.

The experts' weights are kept back to back in one buffer per projection (:meth:`GroupedExperts.pack`,
after construction and after every ``.to()``), so the stacked ``[E, out, in]`` weight is a view of the
parameters, not a copy (:class:`StackedWeights`: forward a view, backward each expert's slice of the
gradient). Where the layout does not hold (weights replaced by someone else) the stack is a copy: the same
numbers, slower.

Used where ``torch.nn.functional.grouped_mm`` exists and runs the case: on a CPU, for SwiGLU experts
without bias, TP or quantisation, whose row widths are multiples of 16 bytes (the kernel's stride rule),
and at least one token (its backward refuses an empty input); anything else runs ``SequentialMLP``'s own
forward. Not on a GPU yet: there megatron's grouped experts are Transformer Engine's, and torch's kernel
for float32 has not been measured.

Imports megatron-core: import it only after :func:`rlite.plugins.megatron.shims.apply_cpu_shims`
(``build_gpt_model`` does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP


def stacked_view(weights: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """``[E, out, in]`` over ``E`` same-shaped contiguous weights that lie back to back in one storage,
    as a view; ``None`` otherwise."""
    first = weights[0]
    if not all(w.is_contiguous() and w.shape == first.shape and w.dtype == first.dtype for w in weights):
        return None
    step = first.numel()
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for index, weight in enumerate(weights):
        if weight.untyped_storage().data_ptr() != storage or weight.storage_offset() != offset + index * step:
            return None
    return first.as_strided((len(weights), *first.shape), (step, *first.stride()))


class StackedWeights(torch.autograd.Function):
    """``torch.stack(weights)`` with no copy where the weights lie back to back (:func:`stacked_view`);
    backward hands each weight its slice of the ``[E, out, in]`` gradient."""

    @staticmethod
    def forward(ctx, *weights: torch.Tensor) -> torch.Tensor:
        view = stacked_view(weights)
        return torch.stack(weights) if view is None else view

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grad.unbind(0)


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` (same modules, parameters and state dict) whose forward is two grouped matrix
    products over all local experts (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pack()

    def projections(self) -> list[list[torch.nn.Parameter]]:
        """Each expert's ``linear_fc1`` weights, then each one's ``linear_fc2`` weights."""
        return [[expert.linear_fc1.weight for expert in self.local_experts],
                [expert.linear_fc2.weight for expert in self.local_experts]]

    def pack(self) -> None:
        """Put each projection's expert weights back to back in one buffer (values unchanged), so that
        :class:`StackedWeights` views them."""
        with torch.no_grad():
            for weights in self.projections():
                buffer = torch.stack([w.detach() for w in weights])
                for weight, row in zip(weights, buffer):
                    weight.data = row

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self.pack()  # .to() / .float() give each parameter its own storage
        return module

    def grouped(self, tokens: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs the grouped path for these tokens (module docstring)."""
        config = self.config
        width = tokens.element_size()
        return (
            hasattr(F, "grouped_mm") and tokens.device.type == "cpu" and self.num_local_experts > 1
            and tokens.shape[0] > 0  # grouped_mm's backward refuses an empty input
            and config.gated_linear_unit and config.activation_func is F.silu and not config.add_bias_linear
            and not (config.fp8 or config.fp4 or config.moe_apply_probs_on_input)
            and config.activation_func_clamp_value is None and config.glu_linear_offset == 0
            and self.tp_group.size() == 1
            and (config.hidden_size * width) % 16 == 0 and (config.moe_ffn_hidden_size * width) % 16 == 0
        )

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        tokens = permuted_local_hidden_states
        if not self.grouped(tokens):
            return super().forward(tokens, tokens_per_expert, permuted_probs)
        offsets = tokens_per_expert.to(tokens.device).cumsum(0, dtype=torch.int32)
        fc1, fc2 = (StackedWeights.apply(*weights) for weights in self.projections())
        hidden = F.grouped_mm(tokens, fc1.transpose(1, 2), offs=offsets)
        gate, up = torch.chunk(hidden, 2, dim=-1)
        hidden = F.silu(gate) * up
        dtype = hidden.dtype
        hidden = (hidden * permuted_probs.unsqueeze(-1)).to(dtype)
        return F.grouped_mm(hidden, fc2.transpose(1, 2), offs=offsets), None
