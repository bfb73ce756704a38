"""The megatron backend's fast paths (issue #32). Log-probs: from the decoder's hidden states through a
chunked output layer (no ``[tokens, vocab]`` logits kept for backward, megatron's output layer never
called) and with a causal ``[1, 1, S, S]`` mask instead of a ``[B, 1, S, S]`` one, each row rotated
past its left padding; equal to the dense-mask path, which rows with holes in their padding still take. Weight sync on one rank:
the Hugging Face tensors are views of the parameters, so an engine that shares weights binds them once."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")

import torch.distributed as dist  # noqa: E402

import rlite.plugins.megatron as megatron_plugin  # noqa: E402
from rlite.api import ConfigError  # noqa: E402
from rlite.plugin_manager import build_plugin_manager  # noqa: E402
from rlite.plugins.megatron import backend as megatron_backend  # noqa: E402
from rlite.plugins.megatron.backend import left_aligned_columns  # noqa: E402
from rlite.testing import SavedActivations, fixed_batch, tiny_config  # noqa: E402
from rlite.tokenizer import build_tiny_model_dir  # noqa: E402
from rlite.training.backend import ForwardSpec  # noqa: E402


def test_rows_are_rotated_past_their_left_padding():
    attention = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    columns, shift = left_aligned_columns(attention)
    assert shift.tolist() == [2, 0, 1]
    assert attention.gather(1, columns).tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert left_aligned_columns(torch.tensor([[1, 0, 1, 1]])) is None  # a hole: no causal-only layout


@pytest.fixture
def backend(tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "moe", hidden=32, layers=2, num_experts=4, experts_per_token=2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")
    cfg = tiny_config(model_dir, tmp_path, "parallelism.backend=megatron", pm=pm)
    made = megatron_plugin.make_megatron(cfg, megatron_plugin.MegatronConfig(), torch.device("cpu"), 1)
    yield made
    made.close()
    dist.destroy_process_group()


def test_hidden_states_through_a_chunked_output_layer_with_a_causal_mask(backend, monkeypatch):
    batch = fixed_batch(num_prompts=3, samples=2, prompt_len=6, max_len=7, vocab=250)
    assert (batch.prompt_mask == 0).any(), "the batch must have left padding"
    spec = ForwardSpec(micro_batch_size=6, temperature=0.8, chunk_size=4, exact_layout=False)
    model, vocab = backend.model, backend.model.output_layer.weight.shape[0]
    masks, output_layer_calls, saved = [], [], []
    model.decoder.register_forward_pre_hook(lambda m, args, kwargs: masks.append(kwargs["attention_mask"]),
                                            with_kwargs=True)
    model.output_layer.register_forward_hook(lambda *args: output_layer_calls.append(1))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        ours, our_entropy = backend.logprobs(batch, spec, with_entropy=True)
    assert masks[0].shape[:2] == (1, 1), "one causal mask broadcast over the batch"
    assert not output_layer_calls, "megatron's output layer (full-vocabulary logits) is skipped"
    assert not [s for s in saved if s[-1] == vocab], f"[tokens, vocab] logits kept for backward: {saved}"
    ours.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    monkeypatch.setattr(megatron_backend, "left_aligned_columns", lambda attention: None)  # the dense-mask path
    dense, dense_entropy = backend.logprobs(batch, spec, with_entropy=True)
    assert masks[-1].shape[0] == 6
    torch.testing.assert_close(ours, dense, atol=2e-5, rtol=0)
    torch.testing.assert_close(our_entropy, dense_entropy, atol=2e-5, rtol=0)
    dense.sum().backward()
    for name, param in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_one_rank_weights_out_are_views_of_the_parameters(backend):
    assert backend.capabilities.weight_views
    storages = {p.untyped_storage().data_ptr() for p in backend.model.parameters()}
    viewed = {name for name, tensor in backend.full_weights(views=True) if tensor.untyped_storage().data_ptr() in storages}
    assert {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate.weight", "model.norm.weight",
            "model.embed_tokens.weight"} <= viewed
    copied = {name for name, tensor in backend.full_weights() if tensor.untyped_storage().data_ptr() in storages}
    assert not copied, "without views every tensor is the consumer's own"
    views = dict(backend.full_weights(views=True))
    for name, tensor in backend.full_weights():
        assert torch.equal(tensor, views[name]), name


def test_activation_checkpointing_recomputes_layers_with_the_same_numbers(tmp_path):
    """``parallelism.activation_checkpointing``: megatron's full recompute keeps each layer's input only
    (far fewer bytes saved for backward) and gives the same log-probs and gradients bitwise."""
    model_dir = build_tiny_model_dir(tmp_path / "moe", hidden=32, layers=2, num_experts=4, experts_per_token=2)
    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")
    batch = fixed_batch(num_prompts=4, samples=4, prompt_len=8, max_len=8, vocab=250)
    spec = ForwardSpec(micro_batch_size=16, temperature=1.0, chunk_size=64, exact_layout=False)
    runs = {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for recompute in (False, True):
            cfg = tiny_config(model_dir, tmp_path / str(recompute), "parallelism.backend=megatron",
                              f"parallelism.activation_checkpointing={recompute}", pm=pm)
            backend = megatron_plugin.make_megatron(cfg, megatron_plugin.MegatronConfig(), torch.device("cpu"), 1)
            backend.train_mode()
            with SavedActivations() as saved:
                logprobs, _ = backend.logprobs(batch, spec)
            logprobs.sum().backward()
            grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
            runs[recompute] = (logprobs.detach(), grads, saved.bytes)
            backend.close()
        with pytest.raises(ConfigError, match="recomputes each layer"):
            cfg = tiny_config(model_dir, tmp_path / "replay", "parallelism.backend=megatron",
                              "parallelism.activation_checkpointing=true", "algorithm.routing_replay=rollout", pm=pm)
            megatron_plugin.make_megatron(cfg, megatron_plugin.MegatronConfig(), torch.device("cpu"), 1)
    finally:
        dist.destroy_process_group()
    assert runs[True][2] * 4 < runs[False][2], (runs[True][2], runs[False][2])
    assert torch.equal(runs[True][0], runs[False][0])
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, grad in runs[False][1].items():
        assert torch.equal(runs[True][1][name], grad), name


@pytest.mark.parametrize("experts,replay", [(None, False), (4, False), (4, True)], ids=["dense", "moe", "moe-replay"])
def test_shared_prompt_forward_runs_each_prompt_once_with_the_same_numbers(tmp_path, experts, replay):
    """``spec.share_prompts``: each distinct prompt runs once, its keys and values gathered to its samples,
    their responses in length groups; the log-probs, entropies and gradients are the full forward's, and
    the decoder sees far fewer tokens (fsdp2's shared-prompt forward, in megatron). Under routing replay
    a group's prompt routes as its first sample did: here every sample's prompt routing is the first's."""
    from rlite.moe_routing import RoutingPlan

    model_dir = build_tiny_model_dir(tmp_path / "m", hidden=32, layers=2, num_experts=experts, experts_per_token=2)
    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")
    batch = fixed_batch(num_prompts=3, samples=4, prompt_len=9, max_len=7, vocab=250,
                        routing=(2, 4, 2) if replay else None)
    assert (batch.prompt_mask == 0).any(), "the batch must have left padding"
    if replay:
        width = batch.prompt_ids.shape[1]
        for row in range(batch.routed_experts.shape[0]):
            batch.routed_experts[row, :width] = batch.routed_experts[row - row % 4, :width]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = tiny_config(model_dir, tmp_path / "run", "parallelism.backend=megatron", pm=pm)
        backend = megatron_plugin.make_megatron(cfg, megatron_plugin.MegatronConfig(), torch.device("cpu"), 1)
        backend.train_mode()
        tokens = []
        backend.model.embedding.register_forward_hook(lambda module, args, out: tokens.append(out.shape[0] * out.shape[1]))
        runs = {}
        for share in (False, True):
            spec = ForwardSpec(micro_batch_size=12, temperature=0.8, chunk_size=5, exact_layout=False, share_prompts=share,
                               routing=RoutingPlan(True) if replay else None)
            tokens.clear()
            logprobs, entropy = backend.logprobs(batch, spec, with_entropy=True)
            (logprobs * torch.linspace(0.5, 1.5, logprobs.shape[1])).sum().backward()
            grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
            backend.model.zero_grad(set_to_none=True)
            runs[share] = (logprobs.detach(), entropy, grads, sum(tokens))
        backend.close()
    finally:
        dist.destroy_process_group()
    (full_lp, full_ent, full_grads, full_tokens), (lp, ent, grads, shared_tokens) = runs[False], runs[True]
    assert shared_tokens < 0.6 * full_tokens, (shared_tokens, full_tokens)
    torch.testing.assert_close(lp, full_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, full_ent, atol=2e-5, rtol=0)
    assert grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only shim")
def test_megatron_is_imported_without_torch_compile_or_metric_writers_on_a_cpu():
    """Shims 5 and 6: on a CPU megatron-core's JIT fuser is its no-op decorator, so importing it does not pull
    in torch's compiler stack (about 66 MiB of RSS), and it imports neither wandb nor tensorboard (24 MiB),
    which stay importable; ``torch.compile`` is torch's own again afterwards."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "compile_ = torch.compile\n"
        "from rlite.plugins.megatron.shims import apply_cpu_shims\n"
        "assert apply_cpu_shims()\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec\n"
        "from megatron.core import jit\n"
        "assert torch.compile is compile_\n"
        "assert jit.jit_fuser is jit.noop_decorator\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor')))[:3])\n"
        "print([m for m in ('wandb', 'torch.utils.tensorboard') if m in sys.modules])\n"
        "import importlib, importlib.util\n"
        "for module, package in (('wandb', 'wandb'), ('torch.utils.tensorboard', 'tensorboard')):\n"
        "    if importlib.util.find_spec(package):  # installed: still importable for rlite's own loggers\n"
        "        importlib.import_module(module)\n"
        "print('importable')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-3:] == ["[]", "[]", "importable"], out.stdout
