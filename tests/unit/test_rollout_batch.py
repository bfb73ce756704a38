"""Row selection and stacking of a batch are driven by each field's declared row layout: a field that
is added to ``RolloutBatch``, ``Scores`` (together a ``ScoredBatch``), ``TrainTargets`` (or to a dataclass
they hold) moves with its rows, or the batch cannot be selected at all; never silently dropped."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

import pytest
import torch

from rlite.rollout import (
    PROMPT,
    EnvResults,
    RolloutBatch,
    ScoredBatch,
    Scores,
    TrainTargets,
    column,
    concat_batches,
    concat_rows,
    row_layout,
    select_rows,
)

PAD = 9


def grid(rows: int, width: int, dtype=torch.float32) -> torch.Tensor:
    """``[rows, width]``, each row's values distinct."""
    return (torch.arange(rows).reshape(rows, 1) * 100 + torch.arange(width) + 1).to(dtype)


def full_targets(rows: int = 3, response: int = 3) -> TrainTargets:
    """Targets with every field set, each row's values distinct."""
    return TrainTargets(**{f.name: grid(rows, response) + i / 10 for i, f in enumerate(fields(TrainTargets))})


def full_batch(rows: int = 3, prompt: int = 2, response: int = 3, layers: int = 2, top_k: int = 2) -> ScoredBatch:
    """A scored batch with every field of every dataclass in it set, each row's values distinct."""
    base = torch.arange(rows).reshape(rows, 1)

    def grid(width: int, dtype=torch.float32) -> torch.Tensor:
        return (base * 100 + torch.arange(width) + 1).to(dtype)

    return ScoredBatch(
        prompt_ids=grid(prompt, torch.long),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
        response_ids=grid(response, torch.long),
        response_mask=torch.ones(rows, response),
        rollout_logprobs=-grid(response),
        group_ids=torch.arange(rows),
        finish_reasons=[f"reason{i}" for i in range(rows)],
        samples=[{"prompt": f"p{i}"} for i in range(rows)],
        completion_texts=[f"text{i}" for i in range(rows)],
        scores=base.squeeze(1).float(),
        correct=base.squeeze(1) % 2 == 0,
        reward_components=grid(2),
        baseline_texts=[f"greedy{i}" for i in range(rows)],
        baseline_scores=base.squeeze(1).float() / 2,
        weight_versions=list(range(rows)),
        routed_experts=grid(prompt + response, torch.int16)[:, :, None, None].expand(-1, -1, layers, top_k).clone(),
        policy_top_ids=grid(response, torch.long)[:, :, None].expand(-1, -1, top_k).clone(),
        policy_top_logprobs=-grid(response)[:, :, None].expand(-1, -1, top_k).clone(),
        response_attention_mask=torch.ones(rows, response),
        token_weight_versions=grid(response, torch.long),
        env=EnvResults(rewards=base.squeeze(1).double() * 1.5, turns=base.squeeze(1) + 1,
                       metrics=[{"correct": float(i % 2)} for i in range(rows)]),
    )


def leaves(obj, prefix=""):
    """``(dotted name, value)`` of every field, through the dataclasses a batch holds."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value


def test_the_fixture_sets_every_field():
    """A new field must be added here too (set), so that the tests below cover it."""
    for rows in (full_batch(), full_targets()):
        unset = [name for name, value in leaves(rows) if value is None or (isinstance(value, list) and not value)]
        assert unset == []


def test_every_field_declares_its_row_layout():
    for cls in (RolloutBatch, Scores, ScoredBatch, TrainTargets, EnvResults):
        for f in fields(cls):
            row_layout(cls, f)


def test_a_scored_batch_is_its_samples_and_their_scores_each_field_once():
    names = [f.name for f in fields(ScoredBatch)]
    assert sorted(names) == sorted(f.name for cls in (RolloutBatch, Scores) for f in fields(cls))
    assert len(names) == len(set(names))
    batch = full_batch()
    samples = RolloutBatch(**{f.name: getattr(batch, f.name) for f in fields(RolloutBatch)})
    scores = Scores(**{f.name: getattr(batch, f.name) for f in fields(Scores)})
    again = ScoredBatch.of(samples, scores)
    assert all(getattr(again, name) is getattr(batch, name) for name in names)  # the same tensors, not copies


@pytest.mark.parametrize("rows", [full_batch, full_targets])
def test_select_keeps_every_field_row_by_row(rows):
    batch = rows()
    picked = batch.select([2, 0])
    for (name, value), (_, got) in zip(leaves(batch), leaves(picked)):
        expected = value[torch.tensor([2, 0])] if isinstance(value, torch.Tensor) else [value[2], value[0]]
        if isinstance(value, torch.Tensor):
            assert torch.equal(got, expected), name
        else:
            assert got == expected, name
    assert len(batch.select(slice(1, 3))) == 2
    for name, value in leaves(batch.select(slice(1, 3))):  # a slice picks the rows a list of them does
        expected = dict(leaves(batch.select([1, 2])))[name]
        assert torch.equal(value, expected) if isinstance(value, torch.Tensor) else value == expected, name


def test_concat_of_selections_is_the_selection_of_their_rows():
    batch = full_batch()
    stacked = concat_batches([batch.select([0]), batch.select([1, 2])], pad_token_id=PAD)
    for (name, value), (_, got) in zip(leaves(batch), leaves(stacked)):
        if isinstance(value, torch.Tensor):
            assert torch.equal(got, value), name
        else:
            assert got == value, name


def test_concat_re_pads_each_field_along_its_axis():
    wide, narrow = full_batch(rows=2, prompt=3, response=4), full_batch(rows=1, prompt=1, response=2)
    stacked = concat_batches([narrow, wide], pad_token_id=PAD)
    assert len(stacked) == 3
    for name, value in leaves(stacked):
        assert value is not None and len(value) == 3, name
    assert stacked.prompt_ids[0].tolist() == [PAD, PAD, 1]  # left: the pad token
    assert stacked.response_ids[0].tolist() == [1, 2, PAD, PAD]  # right: the pad token
    targets = concat_rows([full_targets(rows=1, response=2), full_targets(rows=2, response=4)], [1, 3], (3, 4), PAD)
    assert targets.advantages[0].tolist() == [1.0, 2.0, 0.0, 0.0]
    assert stacked.token_weight_versions[0].tolist() == [1, 2, -1, -1]
    assert stacked.policy_top_ids.shape == (3, 4, 2) and stacked.policy_top_ids[0, 2:].eq(0).all()
    # the routing grid: the prompt part left-padded, the response part right-padded, with -1
    assert stacked.routed_experts[0, :, 0, 0].tolist() == [-1, -1, 1, 2, 3, -1, -1]
    assert torch.equal(stacked.routed_experts[1:], wide.routed_experts)


def test_a_field_some_parts_lack_is_dropped_or_stood_in_for():
    with_attention, without = full_batch(rows=1), full_batch(rows=2)
    without.response_attention_mask, without.baseline_scores, without.env = None, None, None
    without.response_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    stacked = concat_batches([with_attention, without], pad_token_id=PAD)
    assert stacked.baseline_scores is None and stacked.env is None
    # a batch without an attention mask attends where its loss mask is (missing_as="response_mask")
    assert stacked.response_attention_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]


def test_a_field_without_a_layout_is_refused():
    @dataclass
    class Rows:
        ids: torch.Tensor = column(pad=PROMPT)
        undeclared: torch.Tensor | None = None

    with pytest.raises(TypeError, match="Rows.undeclared declares no row layout"):
        select_rows(Rows(torch.zeros(2, 1), torch.zeros(2)), [0])
