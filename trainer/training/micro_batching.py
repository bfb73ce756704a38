"""How a (mini-)batch is cut into micro-batches: a fixed number of sequences, or a token budget.

A micro-batch is a padded rectangle: its prompts are left-padded to its longest prompt and its responses
right-padded to its longest response (:func:`rlite.rollout.model_inputs` trims the columns no row
uses), so its forward computes ``rows x (longest prompt + longest response)`` token positions, real or
padding. That product is what a token budget bounds.

- ``max_tokens == 0``: contiguous runs of ``size`` rows, in batch order (the historical behaviour).
- ``max_tokens > 0``: rows sorted longest first (ties by row) and packed greedily into micro-batches
  of at most ``size`` rows whose padded size stays within ``max_tokens``; sorting puts rows of similar
  length together, so little of each rectangle is padding. With padding-free forwards (``packed``)
  the budget counts real tokens instead. The data-parallel ranks then agree on one
  count (the largest any rank needs; a collective over ``group``) and a rank that needs fewer splits
  its micro-batches with the most rows in two until it has as many, because every rank must run the
  same number of forwards and backwards (FSDP2 gathers parameters in each).

Loss aggregation uses global token and sequence counts (:mod:`rlite.algorithms`), so any split gives
the same gradient up to the order of float additions. Scoring (pi_old, pi_ref, the critic's values)
and training cut a mini-batch the same way, so the first training forward repeats the scoring
forward's shapes and pi_old is bitwise its log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rlite.rollout import RolloutBatch


@dataclass(frozen=True)
class MicroBatching:
    """The micro-batching of one run (``training.micro_batch_size``, ``training.max_tokens_per_micro_batch``)."""

    size: int
    """At most this many sequences per micro-batch."""
    max_tokens: int = 0
    """At most this many padded token positions (rows x width) per micro-batch; 0: no budget."""
    group: Any = None
    """The data-parallel process group whose ranks agree on the number of micro-batches (None: all)."""
    packed: bool = False
    """The forward runs padding-free (``training.pack_sequences``): the budget counts real tokens."""

    def split(self, batch: RolloutBatch) -> list[list[int]]:
        """The row indices of each micro-batch of ``batch`` (every row in exactly one)."""
        rows = len(batch)
        if self.max_tokens <= 0:
            return [list(range(start, min(start + self.size, rows))) for start in range(0, rows, self.size)]
        prompt, response = row_lengths(batch)
        parts = pack_by_budget(prompt, response, self.size, self.max_tokens, packed=self.packed)
        return split_to_count(parts, agreed_count(len(parts), self.group))


def row_lengths(batch: RolloutBatch) -> tuple[list[int], list[int]]:
    """Each row's prompt length and response length (its real tokens, observations included: the widths
    :func:`rlite.rollout.model_inputs` trims a micro-batch to)."""
    return [int(n) for n in batch.prompt_mask.sum(-1).tolist()], [int(n) for n in batch.response_present.sum(-1).tolist()]


def padded_size(rows: list[int], prompt: list[int], response: list[int]) -> int:
    """Token positions a micro-batch of these rows computes: rows x (longest prompt + longest response)."""
    return len(rows) * (max(prompt[r] for r in rows) + max(max(response[r] for r in rows), 1))


def real_size(rows: list[int], prompt: list[int], response: list[int]) -> int:
    """Token positions a padding-free micro-batch of these rows computes: their real tokens."""
    return sum(prompt[r] + max(response[r], 1) for r in rows)


def pack_by_budget(
    prompt: list[int], response: list[int], size: int, max_tokens: int, *, packed: bool = False
) -> list[list[int]]:
    """Rows longest first, each appended to the last micro-batch while it stays within both bounds
    (the budget counts padded positions, or real tokens when the forward is ``packed``)."""
    cost = real_size if packed else padded_size
    order = sorted(range(len(prompt)), key=lambda r: (-(prompt[r] + response[r]), r))
    parts: list[list[int]] = []
    for row in order:
        alone = cost([row], prompt, response)
        if alone > max_tokens:
            raise ValueError(
                f"training.max_tokens_per_micro_batch={max_tokens} is smaller than one sequence of this batch "
                f"({prompt[row]} prompt + {response[row]} response tokens = {alone}): raise it to at least the "
                "longest prompt plus the longest response (data.max_prompt_tokens + rollout.max_new_tokens, or "
                "rollout.max_response_tokens for multi-turn runs)"
            )
        if parts and len(parts[-1]) < size and cost([*parts[-1], row], prompt, response) <= max_tokens:
            parts[-1].append(row)
        else:
            parts.append([row])
    return parts


def agreed_count(count: int, group: Any) -> int:
    """The largest micro-batch count of any data-parallel rank."""
    from rlite.distributed import all_reduce_max

    return int(all_reduce_max(torch.tensor([count]), group).item())


def split_to_count(parts: list[list[int]], count: int) -> list[list[int]]:
    """Split the micro-batches with the most rows (the first of equals) in two until there are ``count``;
    a part of a micro-batch fits the budget its whole did."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        largest = max(range(len(parts)), key=lambda i: (len(parts[i]), -i))
        rows = parts[largest]
        if len(rows) < 2:
            raise ValueError(
                f"the data-parallel ranks need {count} micro-batches and this rank has only {sum(map(len, parts))} "
                "sequences: every rank must hold as many sequences as it has micro-batches"
            )
        half = (len(rows) + 1) // 2
        parts[largest : largest + 1] = [rows[:half], rows[half:]]
    return parts


def padding_stats(batch: RolloutBatch, parts: list[list[int]]) -> tuple[int, int]:
    """``(real tokens, computed token positions)`` of a batch cut into these micro-batches."""
    prompt, response = row_lengths(batch)
    real = sum(prompt) + int(batch.response_present.sum().item())
    return real, sum(padded_size(rows, prompt, response) for rows in parts)
