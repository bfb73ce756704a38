"""Loading at scale: with several ranks the checkpoint is read once (rank 0), the other ranks build the
model on the meta device and receive their FSDP2 shards, and the weights are bitwise those of a plain
``from_pretrained`` (LoRA initialisation, the critic's value head and rotary buffers included).

Before, every rank ran ``from_pretrained`` for the policy, again for the reference model and again for
the critic (8 ranks of a 7B model: over 200 GB of host memory to start). Here rank 1's peak memory may rise by its shards and
one tensor in flight, well under one full copy of the model per model built.
"""

from __future__ import annotations

import pytest
import torch
from rank_workers import sharded_load

from rlite.testing import spawn_ranks
from rlite.tokenizer import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 17.8M parameters (71 MB in fp32); its largest tensor is 4 MB, so a full copy stands out of the noise
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("model"), hidden=512, layers=4, heads=8, kv_heads=4,
                                    intermediate=2048, vocab_size=1024))  # fmt: skip


def test_two_ranks_read_the_checkpoint_once_and_hold_the_plain_loads_weights(tmp_path, model_dir):
    from rlite.config import LoraConfig, ModelConfig
    from rlite.hf_models import apply_lora, load_causal_lm
    from rlite.plugins.fsdp2.backend import PolicyModel
    from rlite.plugins.fsdp2.critic import ValueModel

    spawn_ranks(sharded_load, (2, str(tmp_path / "init"), model_dir, str(tmp_path), True), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["from_pretrained"] == [model_dir] * 3  # policy, reference and critic, on rank 0 only
    assert ranks[1]["from_pretrained"] == []

    torch.manual_seed(0)  # the plain load, as one process does it (LoRA initialised from the same seed)
    cfg = ModelConfig(path=model_dir, lora=LoraConfig(enabled=True, rank=4))
    plain = {"policy": PolicyModel(apply_lora(load_causal_lm(cfg), cfg.lora)), "reference": PolicyModel(load_causal_lm(cfg)),
             "critic": ValueModel(load_causal_lm(cfg))}  # fmt: skip
    expected = {f"{prefix}.{n}": t for prefix, model in plain.items() for n, t in model.state_dict().items()}
    expected.update({f"{prefix}.buffer.{n}": t for prefix, model in plain.items() for n, t in model.named_buffers()})
    got = ranks[0]["weights"]
    assert got.keys() == expected.keys()
    assert [n for n in expected if not torch.equal(got[n], expected[n])] == []
    assert any("lora_A" in n for n in got) and any("rotary_emb.inv_freq" in n for n in got)

    full = sum(t.numel() * t.element_size() for n, t in plain["reference"].state_dict().items())
    for model, rise, rise_0 in zip(("policy", "reference", "critic"), ranks[1]["rise"], ranks[0]["rise"]):
        # rank 1 holds its half of each model and one tensor in flight (0.7 of a model measured here,
        # freed blocks the allocator keeps included), never a full copy (that alone would be 1.0)
        assert rise < full, f"{model}: rank 1's peak memory rose by {rise / full:.2f} of the model"
        # rank 0 holds the one full copy while it hands out the shards (1.5 measured), never two
        assert rise_0 < 1.9 * full, f"{model}: rank 0's peak memory rose by {rise_0 / full:.2f} of the model"
