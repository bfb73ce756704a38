"""Weight gradients added into ``.grad`` in place: the same gradients as autograd's (to float
rounding) over several accumulated backward passes, written into the same tensor every time, and
nothing left for autograd to buffer (the output layer's hand-written backward: test_logprobs.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rlite.plugins.fsdp2.backend import policy_logprobs as forward_logprobs
from rlite.plugins.fsdp2.lean_activations import apply_lean_activations
from rlite.testing import fixed_batch, tiny_qwen2
from rlite.training.backend import ForwardSpec
from rlite.training.grad_accumulation import EmbeddingFunction, LinearFunction, accumulate_in_place
from rlite.training.logprobs import PolicyModel


def _assert_grads_close(reference: nn.Module, model: nn.Module, rel: float = 1e-5) -> None:
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert b.grad is not None, name
        scale = a.grad.abs().max().item()
        assert scale > 0, name
        assert (b.grad - a.grad).abs().max().item() <= rel * scale, name


def _score(policy: PolicyModel, mb, share_prompts: bool):
    spec = ForwardSpec(micro_batch_size=len(mb), temperature=0.9, chunk_size=5, exact_layout=False,
                       entropy_grad=False, share_prompts=share_prompts)
    return forward_logprobs(policy, mb, spec, with_entropy=True)[0]


@pytest.mark.parametrize("lean", [False, True], ids=["hf-modules", "lean-activations"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_in_place_accumulation_gives_autograds_gradients_over_micro_batches(tie, lean):
    """Three accumulated micro-batches with shared prompts (every weight used by two passes, the
    tied matrix by three): the same summed gradients, written into one tensor per parameter."""
    reference = PolicyModel(tiny_qwen2(vocab_size=96, tie=tie)).train()
    if lean:
        apply_lean_activations(reference)
    model = copy.deepcopy(reference)
    counts = accumulate_in_place(model)
    n_params = sum(1 for _ in model.parameters())
    assert counts == {"parameters": n_params, "linear": 2 * 7 + 1, "embedding": 1}
    batch = fixed_batch(num_prompts=3, samples=4, prompt_len=6, max_len=7, vocab=96)
    coeff = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(3))
    storages = None
    for rows in (slice(0, 4), slice(4, 8), slice(8, 12)):
        mb = batch.select(rows)
        for policy in (reference, model):
            (_score(policy, mb, share_prompts=True) * coeff[rows]).sum().backward()
        if storages is None:
            storages = [p.grad.data_ptr() for p in model.parameters()]
    assert [p.grad.data_ptr() for p in model.parameters()] == storages, "accumulated into the same tensors"
    _assert_grads_close(reference, model)


def test_no_weight_gradient_reaches_autograd():
    """The ops return no gradient for a weight that accumulates in place, so autograd never calls
    the weight's accumulation node (where it would buffer and sum a fresh tensor)."""
    model = PolicyModel(tiny_qwen2(vocab_size=96, tie=True)).train()
    apply_lean_activations(model)
    accumulate_in_place(model)
    seen = []
    for p in model.parameters():
        p.register_hook(lambda g, seen=seen: seen.append(g) if g is not None else None)
    batch = fixed_batch(num_prompts=2, samples=2, prompt_len=5, max_len=4, vocab=96)
    _score(model, batch, share_prompts=True).sum().backward()
    assert seen == []
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_unmarked_weights_get_their_gradient_from_autograd():
    """The functions return the gradient for weights that do not accumulate in place (a frozen-free
    copy, or parameters of a model sharded by FSDP2)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=g, requires_grad=True)
    linear = nn.Linear(8, 6)
    y = LinearFunction.apply(x, linear.weight, linear.bias)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    ref = copy.deepcopy(linear)
    x_ref = x.detach().clone().requires_grad_(True)
    ref(x_ref).backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(linear.weight.grad, ref.weight.grad)
    torch.testing.assert_close(linear.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("marked", [False, True])
def test_embedding_gradient_skips_the_padding_row(marked):
    emb = nn.Embedding(10, 4, padding_idx=0)
    ref = copy.deepcopy(emb)
    if marked:
        accumulate_in_place(emb)
    ids = torch.tensor([[0, 3, 3, 7], [1, 0, 3, 9]])
    dy = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        (EmbeddingFunction.apply(ids, emb.weight, 0) if not marked else emb(ids)).backward(dy)
        ref(ids).backward(dy)
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad)
    assert emb.weight.grad[0].abs().sum() == 0 and emb.weight.grad[3].abs().sum() > 0


def test_lora_adapters_accumulate_in_place_and_frozen_weights_get_nothing():
    """With peft LoRA only the adapters train: their nn.Linear modules are swapped, the frozen base
    projections keep autograd's path (no gradient), and the summed gradients match autograd's."""
    from rlite.config import LoraConfig
    from rlite.hf_models import apply_lora

    reference = PolicyModel(apply_lora(tiny_qwen2(vocab_size=96), LoraConfig(enabled=True, rank=4))).train()
    with torch.no_grad():  # peft starts B at zero, which would leave A without a gradient
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    model = copy.deepcopy(reference)
    counts = accumulate_in_place(model)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert counts["parameters"] == len(trainable) > 0 and counts["linear"] == len(trainable)
    assert all("lora_" in name for name in trainable) and counts["embedding"] == 0
    batch = fixed_batch(num_prompts=2, samples=3, prompt_len=5, max_len=6, vocab=96)
    for rows in (slice(0, 3), slice(3, 6)):
        for policy in (reference, model):
            _score(policy, batch.select(rows), share_prompts=True).sum().backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        if not a.requires_grad:
            assert a.grad is None and b.grad is None, name
            continue
        scale = a.grad.abs().max().item()
        assert scale > 0 and (b.grad - a.grad).abs().max().item() <= 1e-5 * scale, name
