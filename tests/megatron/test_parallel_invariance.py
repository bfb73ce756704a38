"""One optimizer step of the megatron backend on a fixed global batch is the same on 1 rank as on 2
ranks with data parallelism, with tensor parallelism 2 (both ranks on the whole batch, heads, MLP and
vocabulary split) and, for a Mixture-of-Experts model, with expert parallelism 2 (each rank holding 2
of the 4 experts, tokens dispatched with megatron's allgather dispatcher), also with ZeRO-1 over either
layout; spawned processes, gloo."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")

from rank_workers import fixed_batch_update  # noqa: E402

from rlite.testing import spawn_ranks  # noqa: E402
from rlite.tokenizer import build_tiny_model_dir  # noqa: E402


def _run(tmp_path, model_dir, world_size, choice, name, replay=False):
    out, init = tmp_path / f"{name}.pt", tmp_path / f"{name}.init"
    args = (world_size, str(init), str(model_dir), str(out), 4, "token-mean", 1, False, "none", False, choice, replay)
    if world_size == 1:
        fixed_batch_update(0, *args)
    else:
        spawn_ranks(fixed_batch_update, args, nprocs=world_size)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize(
    ("experts", "two_ranks"),
    [(None, "megatron"), (None, "{name: megatron, args: {tensor_parallel: 2}}"),
     (4, "{name: megatron, args: {expert_parallel: 2}}"),
     # ZeRO-1 (test_megatron_memory.py has the dense case): experts split over their expert-data-parallel
     # group of 2, or under expert parallelism 2 a group of 1 (not split) while dense parameters still are
     (4, "{name: megatron, args: {distributed_optimizer: true}}"),
     (4, "{name: megatron, args: {expert_parallel: 2, distributed_optimizer: true}}")],
    ids=["dense-dp2", "dense-tp2", "moe-ep2", "moe-dp2-zero1", "moe-ep2-zero1"],
)
def test_two_ranks_equal_one(tmp_path, experts, two_ranks):
    model_dir = build_tiny_model_dir(tmp_path / "model", hidden=32, layers=2, num_experts=experts)
    one = _run(tmp_path, model_dir, 1, "megatron", "one")
    two = _run(tmp_path, model_dir, 2, two_ranks, "two")
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-5, abs=1e-7), key
    initial = {}
    from rlite.config import ModelConfig
    from rlite.hf_models import load_causal_lm

    initial = dict(load_causal_lm(ModelConfig(path=str(model_dir))).named_parameters())
    assert one["params"].keys() == two["params"].keys()
    moved = 0
    for name in one["params"]:
        torch.testing.assert_close(one["params"][name], two["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        moved += not torch.equal(one["params"][name], initial[name].detach())
    assert moved > len(one["params"]) // 2, "the step must have changed the weights"
    if "distributed_optimizer" in two_ranks:
        # rank 0 keeps AdamW's two float32 moments for half of what one rank keeps them for: half of every
        # dense parameter and, of its experts, half each (data parallel) or its own two of four (expert parallel)
        numel = sum(t.numel() for t in one["params"].values())
        assert one["optimizer_bytes"] == 8 * numel
        assert abs(two["optimizer_bytes"] - 8 * numel / 2) <= 8 * len(one["params"]), (two["optimizer_bytes"], numel)


def test_expert_parallel_routing_replay_equals_one_rank(tmp_path):
    """Routing replay under expert parallelism: each token goes to the engine's experts although
    they live on the other rank (megatron's allgather dispatcher), and the step equals one rank's;
    replay changes the step (random engine routings differ from the router's own)."""
    model_dir = build_tiny_model_dir(tmp_path / "model", hidden=32, layers=2, num_experts=4)
    one = _run(tmp_path, model_dir, 1, "megatron", "one", replay=True)
    two = _run(tmp_path, model_dir, 2, "{name: megatron, args: {expert_parallel: 2}}", "two", replay=True)
    natural = _run(tmp_path, model_dir, 1, "megatron", "natural", replay=False)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-5, abs=1e-7), key
    # replay moved the step well beyond the tolerance the two layouts are held to
    assert max(float((one["params"][n] - natural["params"][n]).abs().max()) for n in one["params"]) > 1e-4
    for name in one["params"]:
        torch.testing.assert_close(one["params"][name], two["params"][name], rtol=1e-5, atol=1e-6, msg=name)
