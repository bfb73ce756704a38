"""One optimizer step on a fixed global batch is the same whatever the split:
world size 1 vs 2 (spawned processes, gloo, real FSDP2) and micro-batch 1 x 4 vs 4 x 1,
for every loss-aggregation mode."""

from __future__ import annotations

import pytest
import torch
from rank_workers import fixed_batch_update

from rlite.config import LOSS_AGG_MODES
from rlite.testing import spawn_ranks
from rlite.tokenizer import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _run(tmp_path, model_dir, world_size, micro, mode, name, minibatches=1, share_prompts=False, offload="none",
         plain=False, max_tokens=0, pack=False):
    out = tmp_path / f"{name}.pt"
    init = tmp_path / f"{name}.init"
    args = (world_size, str(init), model_dir, str(out), micro, mode, minibatches, share_prompts, offload, plain,
            "", False, max_tokens, pack)
    if world_size == 1:
        fixed_batch_update(0, *args)
    else:
        spawn_ranks(fixed_batch_update, args, nprocs=world_size)
    return torch.load(out, weights_only=False)


def _assert_same(a, b, rtol=1e-5, atol=1e-7):
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5, abs=1e-7), key
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_1x4_equals_4x1(tmp_path, model_dir, mode):
    # 16 sequences per rank: micro-batch 16 (1 pass) against micro-batch 4 (4 accumulated passes)
    whole = _run(tmp_path, model_dir, 1, 16, mode, "whole")
    split = _run(tmp_path, model_dir, 1, 4, mode, "split")
    _assert_same(whole, split)
    # the step really moved the weights
    assert whole["metrics"]["actor/grad_norm"] > 0


def test_world_size_2_equals_1_every_mode(tmp_path, model_dir):
    for mode in LOSS_AGG_MODES:
        single = _run(tmp_path, model_dir, 1, 16, mode, f"ws1-{mode}")
        double = _run(tmp_path, model_dir, 2, 4, mode, f"ws2-{mode}")  # 2 ranks x 2 micro-batches
        _assert_same(single, double)
        # the weight stream all-gathers asynchronously across 2 ranks and still equals full_tensor()
        assert double["async_gather"] and double["stream_exact"]
        assert single["stream_exact"]
    # AdamW with its moments on disk steps each rank's FSDP2 shard exactly like the in-memory AdamW
    offloaded = _run(tmp_path, model_dir, 2, 4, LOSS_AGG_MODES[-1], "ws2-offload", offload="disk")
    for name, value in double["params"].items():
        assert torch.equal(value, offloaded["params"][name]), name
    assert not list(tmp_path.glob("*-moments-rank*/*.bin")), "the moment files are deleted"


def test_shared_prompt_forward_under_fsdp_equals_full_forward(tmp_path, model_dir):
    """Prompt-prefix sharing calls each FSDP2 block twice per forward; the step must not change.
    Micro-batches of 3 cut groups of 4 samples apart, so partial groups are covered too."""
    full = _run(tmp_path, model_dir, 1, 16, "token-mean", "full")
    shared = _run(tmp_path, model_dir, 1, 3, "token-mean", "shared-ws1", share_prompts=True)
    shared_ws2 = _run(tmp_path, model_dir, 2, 4, "token-mean", "shared-ws2", share_prompts=True)
    _assert_same(full, shared, rtol=1e-4, atol=1e-6)
    _assert_same(full, shared_ws2, rtol=1e-4, atol=1e-6)


def test_plain_model_accumulating_gradients_in_place_equals_fsdp2(tmp_path, model_dir):
    """Without FSDP2 the weight gradients are added into .grad in place by rlite's ops (addmm_,
    index_add_): 4 accumulated micro-batches with shared prompts, with and without the moments on
    disk, give the step that FSDP2 takes on the whole batch in one pass."""
    whole = _run(tmp_path, model_dir, 1, 16, "token-mean", "fsdp2-whole")
    for offload in ("none", "disk"):
        plain = _run(tmp_path, model_dir, 1, 4, "token-mean", f"plain-{offload}", share_prompts=True,
                     offload=offload, plain=True)
        _assert_same(whole, plain, rtol=1e-4, atol=1e-6)
        assert plain["stream_exact"]


@pytest.mark.parametrize("plain", [False, True], ids=["fsdp2", "plain"])
@pytest.mark.parametrize("share_prompts", [False, True])
def test_first_minibatch_of_an_on_policy_step_has_ratio_exactly_one(tmp_path, model_dir, share_prompts, plain):
    """pi_old from the no-grad scoring pass equals the training forward bit for bit, so the first
    mini-batch's ratio is exactly 1 and nothing is clipped (several mini-batches per rollout); also
    for a model without FSDP2, whose training forward runs rlite's in-place-gradient ops."""
    import torch.distributed as dist

    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.plugins.policy_losses import PPOClipConfig, ppo_clip_loss
    from rlite.stages.minibatches import micro_batches, score_logprobs, split_minibatches
    from rlite.testing import fixed_batch
    from rlite.training.backend import ForwardSpec

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        backend = FSDP2Backend.build(ModelConfig(path=model_dir), ParallelismConfig(shard_single_process=not plain),
                                     TrainingConfig(),
                                     torch.device("cpu"), total_optimizer_steps=2)
        batch = fixed_batch(num_prompts=4, samples=4, prompt_len=6, max_len=7, vocab=250)
        spec = ForwardSpec(micro_batch_size=3, temperature=0.9, chunk_size=5, exact_layout=False,
                           share_prompts=share_prompts)
        old = score_logprobs(backend, batch, spec, minibatches=2)
        first = split_minibatches(batch, 2)[0]
        backend.model.train()
        offset = 0
        for mb in micro_batches(first, spec.micro_batch_size):
            logprobs, _ = backend.logprobs(mb, spec)
            mask = mb.response_mask
            old_mb = old[offset : offset + len(mb)]
            offset += len(mb)
            assert torch.equal(logprobs.detach() * mask, old_mb)
            _, metrics = ppo_clip_loss(logprobs, old_mb, torch.randn_like(logprobs), mask, PPOClipConfig())
            ratio = torch.exp(logprobs - old_mb)[mask.bool()]
            assert torch.equal(ratio, torch.ones_like(ratio))
            assert metrics["pg_clipfrac"].sum() == 0
    finally:
        dist.destroy_process_group()


def test_token_budget_micro_batches_equal_the_whole_batch_at_world_size_1_and_2(tmp_path, model_dir):
    """``training.max_tokens_per_micro_batch``: rows regrouped by length into micro-batches of at most 30
    padded positions (about 3 rows of this batch, so 5-6 micro-batches per rank, in another row order)
    give the step of one pass over the whole batch, on one rank and on two (which agree on a count)."""
    whole = _run(tmp_path, model_dir, 1, 16, "token-mean", "budget-whole")
    budget_ws1 = _run(tmp_path, model_dir, 1, 16, "token-mean", "budget-ws1", max_tokens=30)
    budget_ws2 = _run(tmp_path, model_dir, 2, 16, "seq-mean-token-sum", "budget-ws2", max_tokens=30)
    whole_seq = _run(tmp_path, model_dir, 1, 16, "seq-mean-token-sum", "budget-whole-seq")
    _assert_same(whole, budget_ws1)
    _assert_same(whole_seq, budget_ws2)
    for run in (budget_ws1, budget_ws2):
        assert run["metrics"]["batching/micro_batches"] >= 4
        assert run["metrics"]["batching/padding_fraction"] < run["metrics"]["batching/padding_fraction_fixed_size"]
    assert whole["metrics"]["batching/micro_batches"] == 1.0
    assert budget_ws2["metrics"]["batching/rank_imbalance"] >= 1.0


def test_packed_sequences_with_a_token_budget_equal_the_padded_whole_batch_at_world_size_2(tmp_path, model_dir):
    """``training.pack_sequences`` (each micro-batch's real tokens end to end) under a token budget, on
    two FSDP2 ranks, gives the step of one padded pass over the whole batch on one rank."""
    whole = _run(tmp_path, model_dir, 1, 16, "token-mean", "pack-whole")
    packed_ws1 = _run(tmp_path, model_dir, 1, 16, "token-mean", "pack-ws1", pack=True)
    packed_ws2 = _run(tmp_path, model_dir, 2, 16, "token-mean", "pack-ws2", max_tokens=30, pack=True)
    _assert_same(whole, packed_ws1)
    _assert_same(whole, packed_ws2)
