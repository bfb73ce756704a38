"""Lean SwiGLU MLP and RMSNorm: the same forward values as Hugging Face's modules, the same gradients
(to float rounding), fewer saved tensors; only recognised modules are swapped."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rlite.plugins.fsdp2.lean_activations import RMSNormFunction, SwiGLUFunction, apply_lean_activations
from rlite.testing import tiny_qwen2


def _tiny(kind: str, tie: bool = False):
    return tiny_qwen2(vocab_size=97, tie=tie, arch=kind)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_lean_model_matches_hugging_face_forward_bitwise_and_gradients(kind):
    reference = _tiny(kind)
    lean = copy.deepcopy(reference)
    counts = apply_lean_activations(lean)
    assert counts == {"swiglu_mlp": 2, "rmsnorm": 5}  # 2 MLPs; 2 norms per block and the final norm
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    out_ref, out_lean = reference(ids).logits, lean(ids).logits
    assert torch.equal(out_ref, out_lean), "the lean forward runs the same ops"
    target = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(2))
    (out_ref * target).sum().backward()
    (out_lean * target).sum().backward()
    for (name, a), b in zip(reference.named_parameters(), lean.parameters()):
        # float rounding of a different (exact) chain: relative to the gradient's largest entry
        scale = a.grad.abs().max().item()
        assert scale > 0 and (b.grad - a.grad).abs().max().item() <= 1e-5 * scale, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lean_swiglu_gradients_are_autograds_bit_for_bit(dtype):
    """The lean MLP's backward recomputes silu and the product, then runs the very kernels autograd runs
    for the unpatched MLP (silu's own backward on ``dp * u`` in the model's dtype; no float32 chain of
    temporaries), so every gradient is bitwise autograd's, in bf16 as in fp32."""
    reference = tiny_qwen2(vocab_size=97).to(dtype)
    lean = copy.deepcopy(reference)
    apply_lean_activations(lean)
    mlp_ref, mlp_lean = reference.model.layers[0].mlp, lean.model.layers[0].mlp
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 32, generator=g).to(dtype)
    upstream = torch.randn(3, 7, 32, generator=g).to(dtype)
    inputs = [x.clone().requires_grad_(True) for _ in range(2)]
    mlp_ref(inputs[0]).backward(upstream)
    mlp_lean(inputs[1]).backward(upstream)
    assert torch.equal(inputs[0].grad, inputs[1].grad)
    for (name, a), b in zip(mlp_ref.named_parameters(), mlp_lean.parameters()):
        assert torch.equal(a.grad, b.grad), name


def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd keeps for backward while ``fn()``'s output lives."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_lean_functions_save_less_than_autograd():
    torch.manual_seed(0)
    x = torch.randn(64, 32, requires_grad=True)
    gate, up, down = nn.Linear(32, 80, bias=False), nn.Linear(32, 80, bias=False), nn.Linear(80, 32, bias=False)
    eager, _ = _saved_bytes(lambda: down(nn.functional.silu(gate(x)) * up(x)))
    lean, _ = _saved_bytes(lambda: SwiGLUFunction.apply(x, gate.weight, up.weight, down.weight))
    weights = sum(m.weight.numel() * 4 for m in (gate, up, down))
    # eager keeps x, g, silu(g), u, silu(g) * u; lean keeps x, g, u (both keep the weights)
    assert eager - weights == 4 * (64 * 32 + 4 * 64 * 80)
    assert lean - weights == 4 * (64 * 32 + 2 * 64 * 80)

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(32)
    eager, _ = _saved_bytes(lambda: norm(x))
    lean, _ = _saved_bytes(lambda: RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon))
    assert eager - lean == 4 * 64 * 32  # the normalised x is no longer kept


def test_unrecognised_modules_keep_their_forward():
    peft = pytest.importorskip("peft")
    model = _tiny("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["gate_proj", "q_proj"]))
    counts = apply_lean_activations(lora)
    assert counts == {"swiglu_mlp": 0, "rmsnorm": 5}  # a LoRA-wrapped projection is not a plain Linear

    class GeluMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(4, 8, bias=False), nn.Linear(4, 8, bias=False)
            self.down_proj, self.act_fn = nn.Linear(8, 4, bias=False), nn.GELU()

    assert apply_lean_activations(GeluMLP()) == {"swiglu_mlp": 0, "rmsnorm": 0}
