"""Padding-free micro-batches: the real tokens of a padded ``[B, S]`` grid laid end to end.

Shared by the backends that run packed sequences (the fsdp2 policy and critic forwards; megatron's
THD layout would take the same index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """The sequences of a padded ``[B, S]`` micro-batch laid end to end in ``R`` rows of ``C`` tokens.

    Each sequence's tokens are contiguous in its attention mask (prompts left-padded, responses
    right-padded). Sequences go longest first into the first row with room (first-fit decreasing),
    rows as long as the longest sequence, so a row holds several short sequences one after another.
    Position ids restart at 0 for every sequence, which is how the model tells them apart (transformers
    builds a causal mask that never crosses a sequence boundary). The room left at the end of a row is
    filler: its own sequence (positions from 0 again), attended by nothing real, its outputs unread.
    Attention then costs about ``R x C^2`` instead of ``N^2`` for one row of all ``N`` real tokens,
    and the linear layers run on ``R x C`` positions, barely more than ``N``."""

    real: torch.Tensor
    """[B, S] bool: the grid's real tokens."""
    index: torch.Tensor
    """[B, S] long: each real grid cell's position in the flattened ``[R * C]`` packed rows (-1 elsewhere)."""
    rows: int
    """``R``: packed rows."""
    width: int
    """``C``: tokens per packed row (the longest sequence)."""
    source: torch.Tensor
    """[N] long: the real cells' positions in the flattened ``[B * S]`` grid (row-major)."""
    target: torch.Tensor
    """[N] long: where each of them goes in the flattened ``[R * C]`` packed rows."""

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> PackedRows:
        """The packing of a micro-batch, from its attention mask. It reads the mask's values (the lengths), so
        build it from the host copy of the mask and move it with :func:`rlite.training.device.to_device`: on a GPU the forward then
        packs and unpacks with index tensors only, never waiting for the device."""
        real = attention_mask.bool()
        lengths = real.sum(-1).tolist()
        width = max(max(lengths), 1)
        fill: list[int] = []  # tokens used in each packed row
        starts = [0] * len(lengths)
        for seq in sorted(range(len(lengths)), key=lambda b: (-lengths[b], b)):
            row = next((r for r, used in enumerate(fill) if used + lengths[seq] <= width), None)
            if row is None:
                row = len(fill)
                fill.append(0)
            starts[seq] = row * width + fill[row]
            fill[row] += lengths[seq]
        offset = torch.cumsum(real.long(), -1) - 1  # each real cell's place within its sequence
        index = torch.where(real, torch.tensor(starts, device=real.device)[:, None] + offset, -1)
        source = real.flatten().nonzero().squeeze(-1)
        return cls(real, index, len(fill), width, source, index.flatten()[source])

    def pack(self, grid: torch.Tensor, filler: int | float = 0) -> torch.Tensor:
        """``[B, S, ...]`` -> ``[R, C, ...]``: the real cells in their packed places, ``filler`` elsewhere
        (gathered and scattered by index: no boolean mask, whose indexing waits for a GPU)."""
        out = grid.new_full((self.rows * self.width, *grid.shape[2:]), filler)
        out[self.target] = grid.flatten(0, 1)[self.source]
        return out.reshape(self.rows, self.width, *grid.shape[2:])

    def positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``[R, C]`` position ids: each sequence's own, and the filler at a row's end counting from 0
        (a sequence of its own, so no real token attends to it)."""
        packed = self.pack(position_ids, filler=-1).reshape(-1)
        filler = packed < 0
        # positions 0, 1, 2, ... within each run of filler cells (each run ends its row)
        run_start = torch.cummax(torch.where(filler, -1, torch.arange(packed.numel(), device=packed.device)), 0).values
        packed = torch.where(filler, torch.arange(packed.numel(), device=packed.device) - run_start - 1, packed)
        return packed.reshape(self.rows, self.width)

    def unpack(self, packed: torch.Tensor, columns: slice) -> torch.Tensor:
        """``[R * C, ...]`` -> ``[B, width, ...]`` at the grid's ``columns`` (cells that are not real get
        the first packed cell's values: callers read only real cells)."""
        return packed[self.index[:, columns].clamp(min=0)]
