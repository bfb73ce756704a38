"""An SGLang engine over the GPUs of two trainer ranks, at world size 2 on CPU (gloo, spawned ranks,
the fake SGLang): rank 0 starts it with ``tp_size=2``, rank 1 only feeds it. One SGLang batch samples
both ranks' prompts, and TP rank i of the engine loads the weight payload of trainer rank i."""

from __future__ import annotations

import torch
from rank_workers import sglang_fake_run

from rlite.testing import spawn_ranks
from rlite.tokenizer import build_tiny_model_dir


def test_an_engine_spanning_two_ranks_samples_for_both_and_loads_each_ranks_payload(tmp_path):
    model_dir = str(build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2))
    overrides = ["rollout.engine={name: sglang, args: {tp_size: 2, dtype: bfloat16}}", "training.steps=1",
                 "data.num_eval=3", "checkpoint.export_hf=true"]  # fmt: skip
    args = (2, str(tmp_path / "init"), model_dir, str(tmp_path / "run"), str(tmp_path), overrides)
    spawn_ranks(sglang_fake_run, args, nprocs=2)
    leader, member = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert member["engines"] == []  # rank 1 started no engine of its own
    (engine,) = leader["engines"]
    assert engine["server_args"]["tp_size"] == 2 and engine["server_args"]["base_gpu_id"] == 0
    generate = [c for c in engine["calls"] if c[0] == "generate"]
    # one call for both ranks: the rollout (1 prompt x 4 samples each) and the evaluations (3 prompts
    # split 2 + 1, greedy then sampled, before and after training)
    assert generate == [("generate", 3), ("generate", 3), ("generate", 8), ("generate", 3), ("generate", 3)]
    updates = [c for c in engine["calls"] if c[0] == "update_weights_from_tensor"]
    assert updates  # two syncs, one payload per TP rank each (the fake checks the count)
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf_model", dtype=torch.float32)
    expected = {n: p.detach().to(torch.bfloat16) for n, p in trained.named_parameters()}
    for tp_rank, weights in enumerate(engine["rank_weights"]):
        assert weights.keys() == expected.keys(), tp_rank
        assert all(torch.equal(weights[n], expected[n]) for n in expected), tp_rank
