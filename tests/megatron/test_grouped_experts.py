"""The megatron backend's MoE experts as two grouped matrix products (``rlite.plugins.megatron.experts``,
issue #32): the same numbers as megatron's loop over experts (``SequentialMLP``), bitwise on a CPU in float32
and bfloat16, in the full and the shared-prompt forward and their gradients; the stacked weights are views of
the parameters."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")

import torch.distributed as dist  # noqa: E402

import rlite.plugins.megatron as megatron_plugin  # noqa: E402
from rlite.plugin_manager import build_plugin_manager  # noqa: E402
from rlite.testing import fixed_batch, tiny_config  # noqa: E402
from rlite.tokenizer import build_tiny_model_dir  # noqa: E402
from rlite.training.backend import ForwardSpec  # noqa: E402


@pytest.fixture(params=["float32", "bfloat16"])
def backend(tmp_path, request):
    """The megatron backend on a tiny MoE, its model in float32 or bfloat16 (gradients in the same dtype)."""
    model_dir = build_tiny_model_dir(tmp_path / "moe", hidden=32, layers=2, num_experts=4, experts_per_token=2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")
    cfg = tiny_config(model_dir, tmp_path, "parallelism.backend=megatron", f"parallelism.param_dtype={request.param}",
                      f"parallelism.reduce_dtype={request.param}", pm=pm)
    made = megatron_plugin.make_megatron(cfg, megatron_plugin.MegatronConfig(), torch.device("cpu"), 1)
    yield made
    made.close()
    dist.destroy_process_group()


def experts_of(model):
    from rlite.plugins.megatron.experts import GroupedExperts

    found = [layer.mlp.experts for layer in model.decoder.layers]
    assert all(isinstance(experts, GroupedExperts) for experts in found)
    return found


@pytest.mark.parametrize("share", [False, True], ids=["full", "shared-prompts"])
def test_grouped_experts_give_megatrons_loop_numbers_bitwise(backend, monkeypatch, share):
    from rlite.plugins.megatron.experts import GroupedExperts

    batch = fixed_batch(num_prompts=3, samples=4, prompt_len=9, max_len=7, vocab=250)
    spec = ForwardSpec(micro_batch_size=12, temperature=0.8, chunk_size=5, exact_layout=False, share_prompts=share)
    grouped_calls = []
    grouped = GroupedExperts.grouped
    monkeypatch.setattr(GroupedExperts, "grouped", lambda self, tokens: grouped_calls.append(1) or grouped(self, tokens))
    runs = {}
    for path in ("grouped", "loop"):
        if path == "loop":  # SequentialMLP's own forward: one megatron MLP per expert
            monkeypatch.setattr(GroupedExperts, "grouped", lambda self, tokens: False)
        backend.train_mode()
        logprobs, entropy = backend.logprobs(batch, spec, with_entropy=True)
        (logprobs * torch.linspace(0.5, 1.5, logprobs.shape[1])).sum().backward()
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
        backend.model.zero_grad(set_to_none=True)
        runs[path] = (logprobs.detach(), entropy, grads)
    assert grouped_calls, "the grouped path ran"
    (lp, ent, grads), (loop_lp, loop_ent, loop_grads) = runs["grouped"], runs["loop"]
    assert torch.equal(lp, loop_lp)
    assert torch.equal(ent, loop_ent)
    assert grads.keys() == loop_grads.keys() and any(".local_experts.3." in name for name in grads)
    for name, grad in loop_grads.items():
        assert torch.equal(grads[name], grad), name


def test_an_expert_without_tokens_and_a_rank_without_any(backend):
    """Tokens in expert order with an idle expert, and none at all (grouped_mm refuses an empty input in
    backward: that case takes the loop): outputs and weight gradients equal the loop's."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = experts_of(backend.model)[0]
    hidden, dtype = backend.model.config.hidden_size, experts.projections()[0][0].dtype
    for counts in ([3, 0, 5, 2], [0, 0, 0, 0]):
        tokens = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
        probs = torch.rand(sum(counts), generator=torch.Generator().manual_seed(2))
        per_expert = torch.tensor(counts)
        results = []
        for forward in (type(experts).forward, SequentialMLP.forward):
            out, bias = forward(experts, tokens, per_expert, probs)
            assert bias is None
            (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
            results.append((out.detach(), [p.grad.clone() for p in experts.parameters()]))
            experts.zero_grad(set_to_none=True)
        assert torch.equal(results[0][0], results[1][0]), counts
        for ours, theirs in zip(results[0][1], results[1][1]):
            assert torch.equal(ours, theirs), counts


def test_stacked_expert_weights_are_views_of_the_parameters(backend):
    from rlite.plugins.megatron.experts import StackedWeights

    experts = experts_of(backend.model)[0]
    fc1 = experts.projections()[0]
    stacked = StackedWeights.apply(*fc1)
    assert stacked.data_ptr() == fc1[0].data_ptr(), "no copy: the experts' weights lie back to back"
    assert torch.equal(stacked, torch.stack(fc1))
    for dtype in (torch.float64, fc1[0].dtype):  # .to() gives each parameter a storage of its own: packed again
        experts.to(dtype)
        assert StackedWeights.apply(*experts.projections()[0]).data_ptr() == experts.projections()[0][0].data_ptr()
    fc1 = experts.projections()[0]
    # a layout someone else broke: the stack is a copy, and every weight still gets its gradient
    fc1[1].data = fc1[1].detach().clone()
    stacked = StackedWeights.apply(*fc1)
    assert stacked.data_ptr() != fc1[0].data_ptr() and torch.equal(stacked, torch.stack(fc1))
    (stacked * torch.arange(len(fc1)).view(-1, 1, 1)).sum().backward()
    for index, weight in enumerate(fc1):
        assert torch.equal(weight.grad, torch.full_like(weight, float(index)))
