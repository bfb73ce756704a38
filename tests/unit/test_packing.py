"""Padding-free forwards (``training.pack_sequences``): the real tokens of a micro-batch laid end to
end give the padded forward's log-probs, entropy, gradients and critic values to float rounding, with
LoRA and with MoE routing replay, and refuse what they cannot do."""

from __future__ import annotations

import copy

import pytest
import torch

from rlite.plugins.fsdp2.backend import policy_logprobs
from rlite.testing import fixed_batch, tiny_qwen2
from rlite.training.backend import ForwardSpec
from rlite.training.logprobs import PolicyModel
from rlite.training.packing import PackedRows


def test_packed_rows_place_sequences_first_fit_longest_first_hand_computed():
    from rlite.plugins.transformers.engine import position_ids_from_mask

    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0]])
    ids = torch.arange(15).reshape(3, 5)
    rows = PackedRows.of(mask)
    # lengths 3, 5, 2; rows of 5: the 5 fills row 0, the 3 opens row 1, the 2 fits after it
    assert (rows.rows, rows.width) == (2, 5)
    assert rows.pack(ids).tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 12, 13]]
    assert rows.positions(position_ids_from_mask(mask)).tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert rows.index.tolist() == [[-1, 5, 6, 7, -1], [0, 1, 2, 3, 4], [-1, -1, 8, 9, -1]]
    back = rows.unpack(rows.pack(ids).flatten(), slice(1, 4))
    assert torch.equal(back[mask[:, 1:4].bool()], ids[:, 1:4][mask[:, 1:4].bool()])
    # room left at a row's end is filler, its own sequence: positions from 0 again
    short = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 1]])
    rows = PackedRows.of(short)
    assert rows.pack(torch.arange(8).reshape(2, 4), filler=-1).tolist() == [[0, 1, 2, 3], [7, -1, -1, -1]]
    assert rows.positions(position_ids_from_mask(short)).tolist() == [[0, 1, 2, 3], [0, 0, 1, 2]]


def _spec(packed: bool, **kwargs) -> ForwardSpec:
    return ForwardSpec(micro_batch_size=64, temperature=0.9, chunk_size=5, exact_layout=False, pack_sequences=packed,
                       **kwargs)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_forward(lora):
    from rlite.config import LoraConfig
    from rlite.hf_models import apply_lora

    lm = tiny_qwen2(vocab_size=250)
    if lora:
        lm = apply_lora(lm, LoraConfig(enabled=True, rank=4))
        with torch.no_grad():  # adapters that change the output (lora_B starts at zero)
            for name, p in lm.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    padded_model = PolicyModel(lm).train()
    packed_model = copy.deepcopy(padded_model)
    batch = fixed_batch(num_prompts=4, samples=3, prompt_len=6, max_len=7, vocab=250)
    weights = torch.linspace(0.5, 1.5, batch.response_ids.shape[1])
    results = {}
    for packed, model in ((False, padded_model), (True, packed_model)):
        logprobs, entropy = policy_logprobs(model, batch, _spec(packed), with_entropy=True)
        ((logprobs * weights).sum() + entropy.sum()).backward()
        results[packed] = (logprobs.detach(), entropy.detach(), _grads(model))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results[False], results[True]
    assert (lp_a != 0).any()
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=0, atol=2e-5)
    assert g_a.keys() == g_b.keys() and len(g_a) > 0
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packing_is_not_a_no_op_it_runs_fewer_positions(monkeypatch):
    """The decoder sees packed rows as long as the longest sequence, fewer than the padded micro-batch's,
    and no attention mask."""
    model = PolicyModel(tiny_qwen2(vocab_size=250))
    batch = fixed_batch(num_prompts=3, samples=2, prompt_len=6, max_len=7, vocab=250)
    decoder = model.causal_lm.get_decoder()
    seen = []
    original = decoder.forward

    def spy(*args, **kwargs):
        seen.append((tuple(kwargs["input_ids"].shape), kwargs.get("attention_mask")))
        return original(*args, **kwargs)

    monkeypatch.setattr(decoder, "forward", spy)
    with torch.no_grad():
        policy_logprobs(model, batch, _spec(True))
    real = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    rows = PackedRows.of(torch.cat([batch.prompt_mask, batch.response_mask], dim=1))
    (shape, mask), = seen
    assert shape == (rows.rows, rows.width) and mask is None
    longest = int((batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).max())
    assert rows.width == longest and real <= rows.rows * rows.width <= len(batch) * longest


def test_packed_critic_values_equal_the_padded_ones():
    from rlite.plugins.fsdp2.critic import ValueModel
    from rlite.rollout import model_inputs

    model = ValueModel(tiny_qwen2(vocab_size=250))
    with torch.no_grad():
        model.value_head.weight.normal_(generator=torch.Generator().manual_seed(2))
    batch = fixed_batch(num_prompts=3, samples=3, prompt_len=6, max_len=7, vocab=250)
    inputs = model_inputs(batch)
    with torch.no_grad():
        padded, packed = model(inputs), model(inputs, packed=True)
    assert (padded != 0).any()
    torch.testing.assert_close(packed, padded, rtol=0, atol=2e-5)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("moe") / "m", hidden=32, layers=2, num_experts=4)


def test_packed_forward_replays_the_engines_routing_like_the_padded_one(moe_dir):
    from transformers import AutoModelForCausalLM

    from rlite.engines.base import SamplingParams
    from rlite.moe_routing import RoutingPlan, RoutingStats
    from rlite.plugins.transformers.engine import TransformersEngine
    from rlite.rollout import build_rollout_batch

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    engine = TransformersEngine(copy.deepcopy(model), pad_token_id=0, eos_token_ids=[1])
    completions = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=3, return_routed_experts=True))
    batch = build_rollout_batch(prompts, completions, [{}] * len(prompts), 0, 0)
    policy = PolicyModel(model)
    with torch.no_grad():  # routers that disagree with the engine's: only replay routes like it
        for name, p in policy.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 2 * p.abs().mean())
    out = {}
    for packed in (False, True):
        used = RoutingStats(2)
        with torch.no_grad():
            logprobs, _ = policy_logprobs(policy, batch, _spec(packed, routing=RoutingPlan(True, None, used)))
        out[packed] = (logprobs, used)
    (lp_padded, used_padded), (lp_packed, used_packed) = out[False], out[True]
    torch.testing.assert_close(lp_packed, lp_padded, rtol=0, atol=2e-5)
    # every recorded token of both MoE layers follows the engine's experts, and packing runs no padding
    recorded = int((batch.routed_experts[:, :, 0, 0] >= 0).sum())
    assert used_packed.compared.tolist() == [recorded, recorded]
    assert used_packed.matched.tolist() == used_packed.compared.tolist()
    assert used_padded.matched.tolist() == used_padded.compared.tolist()


def test_packing_with_true_on_policy_is_refused_naming_both_keys(tmp_path):
    from rlite.config import ConfigError, load_config
    from rlite.plugin_manager import build_plugin_manager

    with pytest.raises(ConfigError, match="training.pack_sequences=true with rollout.true_on_policy=true"):
        load_config(None, ["model.path=unused", "data.task=addition", "training.pack_sequences=true",
                           "rollout.true_on_policy=true"], pm=build_plugin_manager(autoload=False))
