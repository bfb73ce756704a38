"""Chunked, checkpointed output-layer log-probs and entropy against the plain full-logits formulas."""

from __future__ import annotations

import pytest
import torch

from rlite.rollout import ModelInputs
from rlite.tokenizer import build_tiny_model_dir
from rlite.training.backend import ForwardSpec
from rlite.training.grad_accumulation import accumulate_in_place
from rlite.training.logprobs import LinearLogprobFunction, PolicyModel, chunked_logprobs


def _spec(temperature: float = 1.0, chunk_size: int = 1024, **options) -> ForwardSpec:
    """The forward :class:`PolicyModel` runs (micro-batching is the caller's: unused here)."""
    return ForwardSpec(micro_batch_size=64, temperature=temperature, chunk_size=chunk_size, exact_layout=False,
                       **options)


def _reference(hidden, weight, targets, temperature):
    logits = (hidden @ weight.t()).double() / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_logprobs_and_entropy_match_full_softmax_values_and_gradients(temperature, chunk, recompute):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    lp, ent = chunked_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk, with_entropy=True,
                               recompute=recompute)
    ref_lp, ref_ent = _reference(hidden, weight, targets, temperature)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    coeff = torch.randn(37, generator=g)
    (lp * coeff).sum().backward(retain_graph=True)
    grad_h, grad_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (ref_lp.float() * coeff).sum().backward()
    torch.testing.assert_close(grad_h, hidden.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_w, weight.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("entropy_grad", [True, False], ids=["checkpointed-chunks", "hand-written-backward"])
def test_chunked_path_keeps_no_full_logits_for_backward(entropy_grad):
    """Saved for backward: never [N, V] logits. With the entropy in the graph each chunk is
    checkpointed; otherwise LinearLogprobFunction keeps exactly its inputs."""
    hidden = torch.randn(256, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    targets = torch.randint(0, 1000, (256,))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = chunked_logprobs(hidden, weight, targets, chunk_size=64, with_entropy=True, entropy_grad=entropy_grad)
    assert max(saved) < 256 * 1000  # no [tokens, vocab] tensor is kept
    if not entropy_grad:
        assert sorted(saved) == [256, 256 * 8, 1000 * 8], "only targets, hidden and weight are saved"
    lp.sum().backward()
    assert hidden.grad.abs().sum() > 0 and weight.grad.abs().sum() > 0


@pytest.mark.parametrize("marked", [False, True])
@pytest.mark.parametrize("keep_probs", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_fused_output_layer_logprobs_values_and_gradients(chunk, keep_probs, marked):
    """log p = z_y - logsumexp(z) and the metric entropy against the float64 formulas; backward
    dz = g (onehot - p) / T against autograd through log_softmax, twice accumulated."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(50, 16, generator=g))
    if marked:
        accumulate_in_place(torch.nn.ParameterList([weight]))
    targets = torch.randint(0, 50, (37,), generator=g)
    ref_h = hidden.detach().clone().requires_grad_(True)
    ref_w = weight.detach().clone().requires_grad_(True)
    for seed in (1, 2):
        coeff = torch.randn(37, generator=torch.Generator().manual_seed(seed))
        lp, ent = LinearLogprobFunction.apply(hidden, weight, targets, 0.7, chunk, True, keep_probs)
        assert not ent.requires_grad
        ref_lp, ref_ent = _reference(ref_h, ref_w, targets, 0.7)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
        (lp * coeff).sum().backward()
        (ref_lp.float() * coeff).sum().backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad, ref_w.grad, rtol=1e-4, atol=1e-5)


def test_policy_model_scores_response_tokens_like_the_hf_forward(tmp_path):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(build_tiny_model_dir(tmp_path / "m"))
    policy = PolicyModel(lm)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 250, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding in row 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = torch.ones(3, 4)
    response_mask[1, 3] = 0
    lp, _ = policy(ModelInputs(ids, mask, positions, 5, response_mask), _spec(temperature=0.8, chunk_size=5))
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=mask, position_ids=positions).logits.double() / 0.8
    ref = torch.log_softmax(logits[:, 4:8], -1).gather(-1, ids[:, 5:, None]).squeeze(-1) * response_mask
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
    assert lp[1, 3] == 0.0


def test_liger_path_routes_scaled_hidden_through_fused_cross_entropy(tmp_path, monkeypatch):
    """liger's kernels need CUDA; here a stand-in with liger's call signature checks rlite's side:
    the arguments (weight, h / T, targets) and the sign, against the chunked path."""
    import sys
    import types

    from transformers import AutoModelForCausalLM

    calls = []

    class FakeFusedLinearCrossEntropy:
        def __init__(self, reduction="mean", **kwargs):
            assert reduction == "none"

        def __call__(self, lin_weight, _input, target, bias=None):
            calls.append(_input.shape)
            logits = _input @ lin_weight.t() + (0 if bias is None else bias)
            return torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")

    fake = types.ModuleType("liger_kernel.transformers")
    fake.LigerFusedLinearCrossEntropyLoss = FakeFusedLinearCrossEntropy
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)

    policy = PolicyModel(AutoModelForCausalLM.from_pretrained(build_tiny_model_dir(tmp_path / "m")))
    ids = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = torch.ones(2, 3)
    inputs = ModelInputs(ids, mask, positions, 5, response_mask)
    ref, ref_ent = policy(inputs, _spec(temperature=0.7), with_entropy=True)
    lp, ent = policy(inputs, _spec(temperature=0.7, use_liger=True), with_entropy=True)
    assert calls == [torch.Size([6, 64])]
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent)


def test_liger_option_on_cpu_is_a_clear_config_error(tmp_path):
    from rlite.config import ConfigError
    from rlite.run.policy import check_liger
    from rlite.testing import tiny_config

    cfg = tiny_config(tmp_path, tmp_path / "run", "training.liger_fused_logprobs=true", pm=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="training.liger_fused_logprobs needs CUDA"):
        check_liger(cfg)


def test_entropy_as_a_metric_stays_out_of_the_graph():
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    targets = torch.randint(0, 30, (10,))
    lp, ent = chunked_logprobs(hidden, weight, targets, with_entropy=True, entropy_grad=False, recompute=False)
    assert lp.requires_grad and not ent.requires_grad
    _, ent_with_grad = chunked_logprobs(hidden, weight, targets, with_entropy=True, recompute=False)
    torch.testing.assert_close(ent, ent_with_grad.detach())


@pytest.mark.parametrize("overhead", [32, 0], ids=["one-bucket", "length-buckets"])
@pytest.mark.parametrize("rows", [[0, 0, 0, 1, 1, 1], [0, 1, 1, 2, 2, 2], [0, 0, 1, 2, 2, 3]])
def test_shared_prompt_forward_equals_full_forward_values_and_gradients(tmp_path, rows, overhead, monkeypatch):
    from transformers import AutoModelForCausalLM

    import rlite.training.logprobs
    from rlite.training.logprobs import unique_prompt_rows

    # overhead 0: every distinct response length runs as its own (narrower) forward
    monkeypatch.setattr(rlite.training.logprobs, "BUCKET_OVERHEAD_TOKENS", overhead)

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(build_tiny_model_dir(tmp_path / "m"))
    policy = PolicyModel(lm).train()
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 250, (4, 6), generator=g)
    prompt_mask = torch.ones(4, 6, dtype=torch.long)
    prompt_mask[1, :2] = 0  # a left-padded prompt
    prompt_mask[3, :1] = 0
    responses = torch.randint(0, 250, (len(rows), 5), generator=g)
    response_mask = torch.ones(len(rows), 5)
    response_mask[2, 3:] = 0  # ended early
    response_mask[4, 1:] = 0  # one token: predicted from the prompt alone
    response_mask[0, 4:] = 0
    ids = torch.cat([prompts[rows], responses], 1)
    mask = torch.cat([prompt_mask[rows], response_mask.long()], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    unique, inverse = unique_prompt_rows(ids[:, :6], mask[:, :6])
    assert torch.equal(ids[:, :6][unique][inverse], ids[:, :6])

    def run(share):
        policy.zero_grad(set_to_none=True)
        lp, ent = policy(ModelInputs(ids, mask, positions, 6, response_mask), _spec(temperature=0.9, share_prompts=share),
                         with_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return lp.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    full_lp, full_grads = run(False)
    shared_lp, shared_grads = run(True)
    torch.testing.assert_close(shared_lp, full_lp, rtol=1e-5, atol=1e-5)
    assert full_grads.keys() == shared_grads.keys()
    for name in full_grads:
        torch.testing.assert_close(shared_grads[name], full_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_length_buckets_cover_every_row_once_at_the_lowest_cost():
    import itertools
    import random

    from rlite.training.logprobs import length_buckets

    def cost(buckets, overhead):
        return sum(len(rows) * width + overhead for rows, width in buckets)

    rng = random.Random(0)
    for _trial in range(40):
        lengths = [rng.randint(0, 12) for _ in range(rng.randint(1, 7))]
        overhead = rng.choice([0, 3, 10, 100])
        buckets = length_buckets(lengths, overhead=overhead, max_buckets=3)
        assert sorted(r for rows, _ in buckets for r in rows) == list(range(len(lengths)))
        assert all(width == max(lengths[r] for r in rows) for rows, width in buckets)
        # brute force over every split of the sorted lengths into at most 3 runs
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = float("inf")
        for k in range(1, 4):
            for cuts in itertools.combinations(range(1, len(order)), k - 1):
                parts = [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))]
                best = min(best, cost([(p, max(lengths[i] for i in p)) for p in parts], overhead))
        assert cost(buckets, overhead) == best, (lengths, overhead, buckets)


@pytest.mark.parametrize("found", ["0.5.0", "0.8.1", "0.8.1.post2", None])
def test_liger_older_than_0_8_2_is_refused(found):
    """liger-kernel < 0.8.2 returns wrong weight gradients for reduction="none" with a per-token upstream
    gradient (linkedin/Liger-Kernel#1298): exactly rlite's use, so an older install is a config error."""
    from rlite.config import ConfigError
    from rlite.run.policy import check_liger_version

    with pytest.raises(ConfigError, match=r"training.liger_fused_logprobs: liger-kernel .* 'liger-kernel>=0.8.2'"):
        check_liger_version(found)


@pytest.mark.parametrize("found", ["0.8.2", "0.8.5", "0.9", "1.0.0rc1"])
def test_liger_0_8_2_and_later_pass_the_version_check(found):
    from rlite.run.policy import check_liger_version

    check_liger_version(found)


def test_liger_extra_pins_a_release_with_the_per_token_backward_fix():
    import re
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    (line,) = re.findall(r"^liger = \[(.*)\]$", pyproject, flags=re.M)
    (requirement,) = [Requirement(r.strip().strip('"')) for r in line.split(",")]
    assert requirement.name == "liger-kernel"
    assert not requirement.specifier.contains("0.8.1") and requirement.specifier.contains("0.8.2")
    assert requirement.specifier.contains("0.8.5")  # the version the GPU checks ran
