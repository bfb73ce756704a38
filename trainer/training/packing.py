"""Padding-free micro-batches: the real tokens of a padded ``[B, S]`` grid laid end to end.

Shared by the backends that run packed sequences (the fsdp2 policy and critic forwards; megatron's
THD layout would take the same index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """The real tokens of a padded ``[B, S]`` micro-batch laid end to end: ``[1, N]`` (padding-free).

    Every row's tokens are contiguous in its attention mask (prompts left-padded, responses
    right-padded), so taking the mask's true entries in row-major order concatenates the sequences;
    their position ids restart at 0 for each, which is how the model tells the sequences apart (a
    block-diagonal causal mask: no token attends across a boundary)."""

    real: torch.Tensor
    """[B, S] bool: the grid's real tokens."""
    index: torch.Tensor
    """[B, S] long: each grid cell's position in the packed sequence (-1 on padding)."""

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> PackedRows:
        real = attention_mask.bool()
        index = torch.full(real.shape, -1, dtype=torch.long, device=real.device)
        index[real] = torch.arange(int(real.sum()), device=real.device)
        return cls(real, index)

    def pack(self, grid: torch.Tensor) -> torch.Tensor:
        """``[B, S, ...]`` -> ``[1, N, ...]``: the real cells, end to end."""
        return grid[self.real][None]

    def unpack(self, packed: torch.Tensor, columns: slice) -> torch.Tensor:
        """``[N, ...]`` -> ``[B, width, ...]`` at the grid's ``columns`` (padding cells get row 0's
        values: callers read only real cells)."""
        return packed[self.index[:, columns].clamp(min=0)]
