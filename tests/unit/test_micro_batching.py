"""Token-budget micro-batches (``training.max_tokens_per_micro_batch``): which rows go together, that
every row is scored and trained exactly once in its own place, and that scoring and the first training
forward cut a mini-batch identically (pi_old bitwise the first forward's log-probs)."""

from __future__ import annotations

import pytest
import torch

from rlite.testing import fixed_batch
from rlite.training.backend import ForwardSpec
from rlite.training.micro_batching import (
    MicroBatching,
    pack_by_budget,
    padded_size,
    padding_stats,
    split_to_count,
)


def test_fixed_size_micro_batches_are_contiguous_runs_in_batch_order():
    batch = fixed_batch(num_prompts=3, samples=3, prompt_len=6, max_len=7, vocab=250)
    assert MicroBatching(4).split(batch) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]


def test_budget_packs_longest_first_within_both_bounds_hand_computed():
    prompt, response = [2, 5, 3, 1], [4, 1, 6, 2]
    # totals 6, 6, 9, 3 -> order 2, 0, 1, 3; [2] costs 1 x (3 + 6) = 9; with row 0 it would be
    # 2 x (3 + 6) = 18 > 16, so row 0 starts a part; with row 1: 2 x (5 + 4) = 18 > 16, a new part;
    # row 3 joins row 1: 2 x (5 + 2) = 14 <= 16
    assert pack_by_budget(prompt, response, size=8, max_tokens=16) == [[2], [0], [1, 3]]
    assert padded_size([1, 3], prompt, response) == 14
    # padding-free forwards: the budget counts real tokens: [2, 0] = 9 + 6, [1, 3] = 6 + 3
    assert pack_by_budget(prompt, response, size=8, max_tokens=16, packed=True) == [[2, 0], [1, 3]]
    # the sequence bound holds as well as the token bound
    assert pack_by_budget([1] * 5, [1] * 5, size=2, max_tokens=100) == [[0, 1], [2, 3], [4]]


def test_every_row_once_each_part_within_budget_and_less_padding_than_fixed_size():
    batch = fixed_batch(num_prompts=8, samples=4, prompt_len=6, max_len=7, vocab=250)
    budget = 40
    parts = MicroBatching(16, budget).split(batch)
    assert sorted(r for part in parts for r in part) == list(range(len(batch)))
    prompt, response = batch.prompt_mask.sum(-1).tolist(), batch.response_mask.sum(-1).tolist()
    for part in parts:
        assert len(part) <= 16 and padded_size(part, prompt, response) <= budget
    real, computed = padding_stats(batch, parts)
    real_fixed, computed_fixed = padding_stats(batch, MicroBatching(8).split(batch))
    assert real == real_fixed == sum(prompt) + sum(response)
    assert computed < computed_fixed  # sorting by length pads less than batch order


def test_a_sequence_longer_than_the_budget_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="training.max_tokens_per_micro_batch=5 is smaller than one sequence"):
        pack_by_budget([3, 2], [4, 1], size=8, max_tokens=5)


def test_a_rank_needing_fewer_micro_batches_splits_its_largest():
    assert split_to_count([[0, 1, 2], [3]], 3) == [[0, 1], [2], [3]]
    assert split_to_count([[0, 1], [2, 3]], 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="every rank must hold as many sequences as it has micro-batches"):
        split_to_count([[0], [1]], 3)


class RowwiseModel:
    """Log-probs that depend on each row alone (its tokens), whatever rows share its micro-batch."""

    def __init__(self):
        self.calls: list[int] = []

    def logprobs(self, batch, spec, *, with_entropy=False):
        self.calls.append(len(batch))
        width = int(batch.response_mask.sum(-1).max())
        values = -(batch.response_ids[:, :width].float() + batch.prompt_ids.sum(-1, keepdim=True).float()) / 1000
        return values, None


def test_scoring_with_a_budget_puts_every_row_back_in_its_place():
    from rlite.stages.minibatches import score_logprobs

    batch = fixed_batch(num_prompts=6, samples=4, prompt_len=6, max_len=7, vocab=250)
    whole = score_logprobs(RowwiseModel(), batch, ForwardSpec(len(batch), 1.0, 16, False), minibatches=2)
    model = RowwiseModel()
    budgeted = score_logprobs(model, batch, ForwardSpec(8, 1.0, 16, False, max_tokens_per_micro_batch=30),
                              minibatches=2)
    assert torch.equal(whole, budgeted)
    assert len(model.calls) > 2 and max(model.calls) <= 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def test_first_training_forward_repeats_the_scoring_forward_bitwise_under_a_budget(model_dir, world_of_one):
    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.stages.minibatches import micro_batching, score_logprobs, split_minibatches

    torch.manual_seed(0)
    backend = FSDP2Backend.build(ModelConfig(path=model_dir), ParallelismConfig(), TrainingConfig(lr=1e-2),
                                 torch.device("cpu"), total_optimizer_steps=2)
    try:
        batch = fixed_batch(num_prompts=4, samples=4, prompt_len=6, max_len=7, vocab=250)
        spec = ForwardSpec(micro_batch_size=6, temperature=0.9, chunk_size=5, exact_layout=False,
                           max_tokens_per_micro_batch=36)
        old = score_logprobs(backend, batch, spec, minibatches=2)
        backend.train_mode()
        mini = split_minibatches(batch, 2)[0]
        parts = micro_batching(spec).split(mini)
        assert len(parts) > 1 and parts != MicroBatching(6).split(mini)  # the budget reordered the rows
        for rows in parts:
            logprobs, _ = backend.logprobs(mini.select(rows), spec)
            width = logprobs.shape[1]
            assert torch.equal((logprobs.detach() * mini.select(rows).response_mask[:, :width]),
                               old[rows, :width])
    finally:
        backend.close()
