"""MoE routing: the engine records the experts of every token, the batch carries them on its grid,
the trainer's forward replays them exactly (FSDP2 / Hugging Face routers), agreement is counted as
sets, and SGLang's routed_experts payload decodes to the same layout."""

from __future__ import annotations

import base64
import copy

import numpy as np
import pytest
import torch

from rlite.engines.base import Completion, SamplingParams
from rlite.moe_routing import RouterHooks, RoutingPlan, RoutingStats, decode_routed_experts
from rlite.plugins.fsdp2.backend import policy_logprobs
from rlite.plugins.sglang.payloads import completion_from_output
from rlite.plugins.transformers.engine import TransformersEngine
from rlite.rollout import build_rollout_batch, concat_batches, model_inputs
from rlite.tokenizer import build_tiny_model_dir
from rlite.training.backend import ForwardSpec
from rlite.training.logprobs import PolicyModel


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("moe") / "m", hidden=32, layers=2, num_experts=4)


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]


def sample(model, *, n=2, seed=3, **engine_kwargs):
    engine = TransformersEngine(copy.deepcopy(model), pad_token_id=0, eos_token_ids=[1], **engine_kwargs)
    completions = engine.generate(PROMPTS, SamplingParams(n=n, max_new_tokens=6, seed=seed, return_routed_experts=True))
    return build_rollout_batch(PROMPTS, completions, [{}] * len(PROMPTS), 0, 0), completions


def spec(plan=None, **kwargs):
    return ForwardSpec(micro_batch_size=64, temperature=1.0, chunk_size=64, exact_layout=False, routing=plan, **kwargs)


def natural_topk(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), L, K] the router's own top-k of one sequence, alone in its batch."""
    hooks = RouterHooks.attach(model)
    try:
        with torch.no_grad(), hooks.recording():
            model(input_ids=torch.tensor([ids]))
            return hooks.take(len(ids))
    finally:
        hooks.remove()


def same_sets(a, b) -> bool:
    a, b = torch.as_tensor(np.asarray(a)).long(), torch.as_tensor(np.asarray(b)).long()
    return bool((a.sort(-1).values == b.sort(-1).values).all())


@pytest.mark.parametrize("mode", ["loop", "loop-no-shared-prefill", "true-on-policy"])
def test_engine_records_the_routing_of_every_token_it_ran(moe_dir, mode):
    """A completion's routing has prompt + response - 1 rows (SGLang's layout) and equals the routers'
    top-k of a teacher-forced forward of those tokens."""
    model = load(moe_dir)
    kwargs = {"loop": {}, "loop-no-shared-prefill": {"share_prefill": False}, "true-on-policy": {"true_on_policy": True}}
    _, completions = sample(model, **kwargs[mode])
    for c in completions:
        prompt = PROMPTS[c.prompt_index]
        ran = prompt + c.token_ids[:-1]
        assert c.routed_experts.shape == (len(ran), 2, 2)
        assert c.routed_experts.dtype == np.int32
        assert same_sets(c.routed_experts, natural_topk(model, ran))


def test_batch_grid_places_routing_next_to_its_tokens(moe_dir):
    batch, completions = sample(load(moe_dir))
    width = batch.prompt_ids.shape[1]
    assert batch.routed_experts.shape[:2] == (len(completions), width + batch.response_ids.shape[1])
    for row, c in enumerate(completions):
        p = len(PROMPTS[c.prompt_index])
        grid = batch.routed_experts[row]
        assert (grid[: width - p] == -1).all()  # left padding
        assert torch.equal(grid[width - p : width + len(c.token_ids) - 1].int(), torch.from_numpy(c.routed_experts))
        assert (grid[width + len(c.token_ids) - 1 :] == -1).all()  # the last token never ran; padding
    # selection, re-padding and the trimmed model inputs keep routing aligned with the tokens
    inputs = model_inputs(batch)
    assert inputs.routed_experts.shape[:2] == inputs.input_ids.shape
    merged = concat_batches([batch.select([0]), batch.select([3, 4])], pad_token_id=0)
    again = concat_batches([batch.select([0]), batch.select([3, 4])], pad_token_id=0)
    assert torch.equal(merged.routed_experts, again.routed_experts)
    for row, source in enumerate([0, 3, 4]):
        shift = merged.prompt_ids.shape[1] - width
        real = merged.prompt_mask[row].bool()
        assert torch.equal(merged.prompt_ids[row][real], batch.prompt_ids[source][batch.prompt_mask[source].bool()])
        assert torch.equal(merged.routed_experts[row, shift:], batch.routed_experts[source, : merged.routed_experts.shape[1] - shift])


@pytest.mark.parametrize("share_prompts", [False, True])
def test_replaying_the_trainers_own_routing_is_its_natural_forward_bit_for_bit(moe_dir, share_prompts):
    """The gating weights recomputed on forced experts are exactly the router's own when the forced
    experts are its own choice: values and gradients are bitwise those of the plain forward."""
    model = load(moe_dir)
    batch, _ = sample(model)
    inputs = model_inputs(batch)
    hooks = RouterHooks.attach(model)
    with torch.no_grad(), hooks.recording():
        model.get_decoder()(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                            position_ids=inputs.position_ids)
        own = hooks.take(inputs.input_ids.numel()).view(*inputs.input_ids.shape, 2, 2)
    hooks.remove()
    batch.routed_experts = torch.cat([  # the trainer's own routing in place of the engine's, on the full grid
        torch.full((len(batch), batch.prompt_ids.shape[1] - inputs.response_start, 2, 2), -1, dtype=torch.int16),
        own.to(torch.int16),
        torch.full((len(batch), batch.response_ids.shape[1] - inputs.response_mask.shape[1], 2, 2), -1, dtype=torch.int16),
    ], dim=1)
    policy = PolicyModel(model)
    results = []
    for plan in (None, RoutingPlan(replay=True)):
        policy.zero_grad(set_to_none=True)
        logprobs, _ = policy_logprobs(policy, batch, spec(plan, share_prompts=share_prompts))
        (logprobs * batch.response_mask).sum().backward()
        results.append((logprobs.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}))
    (plain, plain_grads), (replayed, replayed_grads) = results
    assert torch.equal(plain, replayed)
    assert plain_grads.keys() == replayed_grads.keys()
    assert any("mlp.gate.weight" in n for n in replayed_grads)  # the router still learns under replay
    for name in plain_grads:
        assert torch.equal(plain_grads[name], replayed_grads[name]), name


@pytest.mark.parametrize("share_prompts", [False, True])
def test_replay_routes_to_the_engines_experts_whatever_the_router_weights(moe_dir, share_prompts):
    model = load(moe_dir)
    batch, _ = sample(model)
    policy = PolicyModel(model)
    with torch.no_grad():  # a trainer whose routers now disagree with the engine's
        for name, p in policy.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 2 * p.abs().mean())

    def run(replay: bool):
        router, used = RoutingStats(2), RoutingStats(2)
        with torch.no_grad():
            logprobs, _ = policy_logprobs(policy, batch, spec(RoutingPlan(replay, router, used), share_prompts=share_prompts))
        return logprobs, router, used

    _, router_natural, used_natural = run(False)
    logprobs, router_replay, used_replay = run(True)
    recorded = batch.routed_experts[:, :, 0, 0] >= 0
    width = batch.prompt_ids.shape[1]
    prompt_rows = recorded[::2, :width] if share_prompts else recorded[:, :width]  # a group's prompt runs once
    tokens = int(prompt_rows.sum() + recorded[:, width:].sum())
    assert used_replay.compared.tolist() == [tokens, tokens]  # every recorded token of every MoE layer
    assert used_replay.matched.tolist() == used_replay.compared.tolist()  # the engine's experts, exactly
    natural = used_natural.matched.sum() / used_natural.compared.sum()
    assert natural < 0.9  # the perturbed routers would route many tokens elsewhere
    assert torch.equal(used_natural.matched, router_natural.matched)  # routing naturally, own choice = used
    assert (router_replay.matched < router_replay.compared).any()  # the routers still disagree under replay
    # and a forward without any replay (None plan) equals the natural one
    with torch.no_grad():
        plain, _ = policy_logprobs(policy, batch, spec(None, share_prompts=share_prompts))
    assert not torch.equal(plain, logprobs)


def test_replay_under_activation_checkpointing_recomputes_with_the_same_experts(moe_dir):
    model = load(moe_dir)
    batch, _ = sample(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 2 * p.abs().mean())
    grads = []
    for checkpointing in (False, True):
        lm = copy.deepcopy(model)
        policy = PolicyModel(lm)
        if checkpointing:
            lm.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": policy.routers.checkpoint_context}
            )
        policy.train()
        logprobs, _ = policy_logprobs(policy, batch, spec(RoutingPlan(replay=True)))
        (logprobs * batch.response_mask).sum().backward()
        grads.append({n: p.grad for n, p in policy.named_parameters() if p.grad is not None})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_routing_stats_compare_sets_and_skip_unrecorded_tokens():
    stats = RoutingStats(3)
    chosen = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    reference = torch.tensor([[1, 0], [2, 1], [-1, -1], [2, 3]])
    stats.add(1, chosen, reference)
    assert stats.compared.tolist() == [0, 3, 0]  # the -1 row is not compared
    assert stats.matched.tolist() == [0, 2, 0]  # order inside the top-k does not matter
    stats.add(2, chosen[:2], chosen[:2])
    assert stats.metrics("a") == {"a": 4 / 5, "a_min_layer": 2 / 3, "a_max_layer": 1.0}
    assert RoutingStats(2).metrics("a") == {}


def test_sglang_routed_experts_payload_decodes_to_the_completion_layout():
    prompt, tokens = [4, 5, 6], [7, 8]
    values = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2) % 8  # 3 + 2 - 1 rows
    meta = {
        "output_token_logprobs": [(-0.5, 7, None), (-0.25, 8, None)],
        "finish_reason": {"type": "stop"},
        "routed_experts": base64.b64encode(values.tobytes()).decode(),
    }
    completion = completion_from_output({"meta_info": meta}, prompt_index=0, weight_version=1, routing=(len(prompt), 3, 2))
    assert np.array_equal(completion.routed_experts, values)
    with pytest.raises(ValueError, match="expected 5 tokens x 3 layers x 2"):
        decode_routed_experts(meta["routed_experts"], 5, 3, 2)
    batch = build_rollout_batch([prompt], [completion], [{}], 0, 0)
    assert torch.equal(batch.routed_experts[0, :4].int(), torch.from_numpy(values))
    bad = Completion(0, tokens, [0.0, 0.0], "stop", 1, routed_experts=values[:3])
    with pytest.raises(ValueError, match="routed_experts of completion 0"):
        build_rollout_batch([prompt], [bad], [{}], 0, 0)


def test_fp8_quantizer_rounds_expert_stacks_matrix_by_matrix():
    from rlite.plugins.quantizers import Fp8BlockwiseConfig, fp8_blockwise

    stack = torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(0))
    cfg = Fp8BlockwiseConfig(block_size=4)
    out = fp8_blockwise("model.layers.0.mlp.experts.gate_up_proj", stack, cfg)
    for e in range(3):
        assert torch.equal(out[e], fp8_blockwise("x.q_proj.weight", stack[e], cfg))
    assert not torch.equal(out, stack)
    router = torch.randn(4, 8)
    assert fp8_blockwise("model.layers.0.mlp.gate.weight", router, cfg) is router  # routers stay exact


def test_a_dense_model_without_decoder_layers_still_builds_an_engine_and_reports_no_routing():
    """GPT-2 keeps its blocks in ``transformer.h``: no routers to hook, and no error for it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, eos_token_id=1, bos_token_id=1))
    engine = TransformersEngine(model, pad_token_id=0, eos_token_ids=[1])
    assert engine.routers is None and PolicyModel(model).routers is None
    completions = engine.generate([[5, 6]], SamplingParams(n=1, max_new_tokens=3, seed=0, return_routed_experts=True))
    assert completions[0].routed_experts is None


def sigmoid_router_model(family: str):
    """A tiny DeepSeek-V3 or GLM-4.5-style MoE: sigmoid scores, a selection bias (random, so the chosen
    experts are not the top scores), 4 groups of 2 experts of which 2 groups are eligible, a dense
    first layer, renormalised and scaled gating weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
                  topk_group=2, first_k_dense_replace=1, max_position_embeddings=64, routed_scaling_factor=2.5,
                  norm_topk_prob=True)
    torch.manual_seed(0)
    if family == "deepseek_v3":
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**common, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                                       qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8))
    else:
        model = Glm4MoeForCausalLM(Glm4MoeConfig(**common, num_key_value_heads=2, head_dim=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=g) * 0.5)
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_routers_are_recorded_and_replayed_exactly(family):
    """DeepSeek-V3's router family: the engine records its (biased, group-limited) choice; replaying
    the model's own routing is its plain forward bit for bit (values and gradients: the sigmoid scores
    of the chosen experts, renormalised with its epsilon and scaled by routed_scaling_factor); after
    its routers are perturbed, replay still sends every token to the engine's experts."""
    from rlite.moe_routing import routing_shape_of

    model = sigmoid_router_model(family)
    shape = routing_shape_of(model)
    assert (shape.num_layers, shape.top_k, shape.num_experts, shape.moe_layers) == (3, 2, 8, (1, 2))
    batch, completions = sample(model)
    for c in completions:
        ran = PROMPTS[c.prompt_index] + c.token_ids[:-1]
        assert same_sets(c.routed_experts[:, 1:], natural_topk(model, ran)[:, 1:])
        assert (c.routed_experts[:, 0] == -1).all()  # the dense first layer routes nothing
    policy = PolicyModel(model)
    results = []
    for plan in (None, RoutingPlan(replay=True)):
        policy.zero_grad(set_to_none=True)
        logprobs, _ = policy_logprobs(policy, batch, spec(plan))
        (logprobs * batch.response_mask).sum().backward()
        results.append((logprobs.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}))
    (plain, plain_grads), (replayed, replayed_grads) = results
    assert torch.equal(plain, replayed)
    assert any("mlp.gate.weight" in n for n in replayed_grads)
    for name in plain_grads:
        assert torch.equal(plain_grads[name], replayed_grads[name]), name
    # the engine's KV cache holds MLA's keys and values at their own widths (16 and 8 for DeepSeek-V3):
    # what it sampled with is what the trainer computes
    mask = batch.response_mask.bool()
    torch.testing.assert_close(batch.rollout_logprobs[mask], plain[mask], rtol=0, atol=1e-5)

    with torch.no_grad():  # routers that now disagree with the engine's
        for name, p in policy.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 2 * p.abs().mean())
    used = {replay: RoutingStats(3) for replay in (False, True)}
    with torch.no_grad():
        for replay in (False, True):
            policy_logprobs(policy, batch, spec(RoutingPlan(replay, used_stats=used[replay])))
    assert used[True].matched.tolist() == used[True].compared.tolist() and used[True].compared.sum() > 0
    assert used[False].matched.sum() < 0.9 * used[False].compared.sum()
